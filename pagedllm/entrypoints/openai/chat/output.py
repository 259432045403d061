"""The assistant message of each chat choice: content and, when the request has
a tool parser, ``tool_calls`` (whole, or as OpenAI's streaming deltas).

A choice that made calls finishes with ``"tool_calls"`` when the model stopped
by itself, as OpenAI does (also for a named tool choice, where vLLM says
``"stop"``); a choice cut by ``max_tokens`` keeps ``"length"``, so a client can
tell its last call may be incomplete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.common.reasoning import ReasoningSplitter
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallRecord
from pagedllm.outputs import CompletionOutput


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatOutput:
    """One API request's assistant messages, per choice index.

    With a reasoning parser the thinking is split off first (``reasoning_content``,
    left out with ``show_reasoning`` false: vLLM's ``include_reasoning``); the tool
    parser reads only the answer after it."""

    def __init__(self, new_tool_parser: Callable[[], ToolCallRecord] | None,
                 new_reasoning_splitter: Callable[[], ReasoningSplitter] | None = None,
                 show_reasoning: bool = True) -> None:
        self.new_tool_parser = new_tool_parser
        self.new_reasoning_splitter = new_reasoning_splitter
        self.show_reasoning = show_reasoning
        self._parsers: dict[int, ToolCallRecord] = {}
        self._splitters: dict[int, ReasoningSplitter] = {}

    def message(self, completion: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The whole message and the choice's finish reason."""
        text, message = completion.text, {"role": "assistant"}
        if self.new_reasoning_splitter is not None:
            splitter = self.new_reasoning_splitter()
            text = splitter.take(text, finished=True).content
            if self.show_reasoning:
                message["reasoning_content"] = splitter.reasoning
        if self.new_tool_parser is None:
            return {**message, "content": text}, completion.finish_reason
        parser = self.new_tool_parser()
        parser.take(text, finished=True)
        content, tool_calls = parser.message()
        message["content"] = content
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message, _finish_reason(completion.finish_reason, bool(tool_calls))

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The stream delta for the choice's new ``text`` (None: nothing to send
        yet, a parser holds it back) and the finish reason to report."""
        delta: dict[str, Any] = {}
        finished = finish_reason is not None
        if self.new_reasoning_splitter is not None:
            split = self._splitters.setdefault(index, self.new_reasoning_splitter()).take(text, finished)
            if split.reasoning and self.show_reasoning:
                delta["reasoning_content"] = split.reasoning
            text = split.content
        called = False
        if self.new_tool_parser is None:
            if text:
                delta["content"] = text
        else:
            parser = self._parsers.setdefault(index, self.new_tool_parser())
            parsed = parser.take(text, finished)
            if parsed.content:
                delta["content"] = parsed.content
            if parsed.tool_calls:
                delta["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            called = bool(parser.calls)
        if not delta and not finished:
            return None, None
        return delta, _finish_reason(finish_reason, called)

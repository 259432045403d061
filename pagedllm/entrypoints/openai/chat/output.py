"""The assistant message of each chat choice: content and, when the request has
a tool parser, ``tool_calls`` (whole, or as OpenAI's streaming deltas).

A choice that made calls finishes with ``"tool_calls"`` when the model stopped
by itself, as OpenAI does (also for a named tool choice, where vLLM says
``"stop"``); a choice cut by ``max_tokens`` keeps ``"length"``, so a client can
tell its last call may be incomplete.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.entrypoints.openai.chat.events import ChoiceResult, MessageDelta, ToolCall
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

    def result(self, index: int, completion: CompletionOutput) -> ChoiceResult:
        """The whole choice."""
        text, reasoning = completion.text, None
        shows_reasoning = self.new_reasoning_splitter is not None and self.show_reasoning
        if self.new_reasoning_splitter is not None:
            splitter = self.new_reasoning_splitter()
            text = splitter.take(text, finished=True).content
            reasoning = splitter.reasoning
        content, calls, finish_reason = text, (), completion.finish_reason
        if self.new_tool_parser is not None:
            parser = self.new_tool_parser()
            parser.take(text, finished=True)
            content, tool_calls = parser.message()
            calls = tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in tool_calls)
            finish_reason = _finish_reason(completion.finish_reason, bool(calls))
        return ChoiceResult(index, content, calls, reasoning if shows_reasoning else None, shows_reasoning,
                            finish_reason, completion.stop_reason, completion.logprobs)

    def delta(self, index: int, text: str, finish_reason: str | None) -> MessageDelta | None:
        """What the choice's new ``text`` adds, with the finish reason to report
        (None: nothing to send yet, a parser holds it back)."""
        finished = finish_reason is not None
        reasoning = None
        if self.new_reasoning_splitter is not None:
            split = self._splitters.setdefault(index, self.new_reasoning_splitter()).take(text, finished)
            if split.reasoning and self.show_reasoning:
                reasoning = split.reasoning
            text = split.content
        if self.new_tool_parser is None:
            delta = MessageDelta(reasoning, text or None, (), finish_reason)
        else:
            parser = self._parsers.setdefault(index, self.new_tool_parser())
            parsed = parser.take(text, finished)
            delta = MessageDelta(reasoning, parsed.content or None, tuple(parsed.tool_calls),
                                 _finish_reason(finish_reason, bool(parser.calls)))
        if delta.reasoning is None and delta.content is None and not delta.tool_calls and not finished:
            return None
        return delta

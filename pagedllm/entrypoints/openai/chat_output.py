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

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallRecord
from pagedllm.outputs import CompletionOutput


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatOutput:
    """One API request's assistant messages, per choice index."""

    def __init__(self, new_tool_parser: Callable[[], ToolCallRecord] | None) -> None:
        self.new_tool_parser = new_tool_parser
        self._parsers: dict[int, ToolCallRecord] = {}

    def message(self, completion: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The whole message and the choice's finish reason."""
        if self.new_tool_parser is None:
            return {"role": "assistant", "content": completion.text}, completion.finish_reason
        parser = self.new_tool_parser()
        parser.feed(completion.text)
        parser.finish()
        content, tool_calls = parser.message()
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message, _finish_reason(completion.finish_reason, bool(tool_calls))

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The stream delta for the choice's new ``text`` (None: nothing to send
        yet, the parser holds it back) and the finish reason to report."""
        if self.new_tool_parser is None:
            return {"content": text}, finish_reason
        parser = self._parsers.setdefault(index, self.new_tool_parser())
        parsed = parser.feed(text)
        if finish_reason is not None:
            end = parser.finish()
            parsed.content += end.content
            parsed.tool_calls += end.tool_calls
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        if not delta and finish_reason is None:
            return None, None
        return delta, _finish_reason(finish_reason, bool(parser.calls))

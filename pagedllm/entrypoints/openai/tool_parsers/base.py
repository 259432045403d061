"""What every tool-call parser shares: the OpenAI delta shapes, and the record of
the calls and content parsed so far.

A parser is fed the model's output text piece by piece (``feed``) and once at
the end (``finish``); each returns the delta to stream. The whole response is
built from the same record, so a streamed response and a whole one of the same
text always agree: the parser sees the same text either way, and whether it
came in one piece or many does not change what it decides.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: the first carries ``id`` and ``name`` (and
    arguments ""), later ones a piece of the arguments' JSON text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """What one ``feed`` or ``finish`` adds: content text and call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallRecord:
    """The calls and content parsed so far; subclasses decide what text is what.

    ``_content`` applies the whitespace rule: whitespace that touches a call
    (before it or after it) is not content, so the whitespace between calls
    never shows up as a content delta.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._content_parts: list[str] = []
        self._pending_whitespace = ""
        self._after_call = False
        self._delta = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self._parse(text)
        return self._take_delta()

    def finish(self) -> ParsedDelta:
        self._finish()
        self._emit(self._pending_whitespace)
        self._pending_whitespace = ""
        return self._take_delta()

    def take(self, text: str, finished: bool) -> ParsedDelta:
        """``feed(text)``, and when the output ``finished`` what ``finish`` adds too."""
        delta = self.feed(text)
        if finished:
            end = self.finish()
            delta.content += end.content
            delta.tool_calls += end.tool_calls
        return delta

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The final message's ``content`` (None when only calls were made) and ``tool_calls``."""
        content = "".join(self._content_parts)
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in self.calls]
        return (None if tool_calls and not content else content), tool_calls

    def _parse(self, text: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _take_delta(self) -> ParsedDelta:
        delta, self._delta = self._delta, ParsedDelta()
        return delta

    def _emit(self, text: str) -> None:
        if text:
            self._content_parts.append(text)
            self._delta.content += text

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_whitespace + text
        kept = text.rstrip()
        self._pending_whitespace = text[len(kept):]
        self._emit(kept)

    def _start_call(self, name: str) -> None:
        self._pending_whitespace = ""
        self._after_call = True
        call = {"id": new_call_id(), "name": name, "arguments": ""}
        self.calls.append(call)
        self._delta.tool_calls.append(ToolCallDelta(len(self.calls) - 1, "", call["id"], name))

    def _add_arguments(self, piece: str) -> None:
        if not piece:
            return
        index = len(self.calls) - 1
        self.calls[index]["arguments"] += piece
        pending = self._delta.tool_calls
        if pending and pending[-1].index == index and pending[-1].id is None:
            pending[-1].arguments += piece  # one arguments delta per call per chunk
        else:
            pending.append(ToolCallDelta(index, piece))

"""Parsers for the outputs a forced tool choice constrains with a grammar.

- A named function (``tool_choice: {"type": "function", "function": {"name"}}``):
  the whole output is that function's arguments object.
- ``tool_choice: "required"``: the output is a JSON array of
  ``{"name": ..., "parameters": {...}}`` objects, one per call (vLLM's format).

Both stream the arguments as they are generated. Text outside the array (the
grammar allows none but whitespace) is content, so nothing is lost.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallRecord
from pagedllm.entrypoints.openai.tool_parsers.call_object import CallObjectStream, JsonValueEnd, parse_whole_call


class NamedToolParser(ToolCallRecord):
    """The whole output is the arguments of one call to ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _parse(self, text: str) -> None:
        if not self.calls:
            self._start_call(self.name)
        self._add_arguments(text)

    def _finish(self) -> None:
        if not self.calls:
            self._start_call(self.name)


class RequiredToolParser(ToolCallRecord):
    """A JSON array of ``{"name", "parameters"}`` call objects."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "before"  # before the array, "between" elements, in an "element", "after" the array
        self._element: CallObjectStream | None = None
        self._element_end: JsonValueEnd | None = None
        self._element_text = ""

    def _parse(self, text: str) -> None:
        while text:
            if self._state == "element":
                text = self._element_piece(text)
                continue
            head = text.lstrip(" \t\r\n" + ("," if self._state == "between" else ""))
            if not head:
                return
            char, text = head[0], head
            if self._state == "before" and char == "[":
                self._state, text = "between", head[1:]
            elif self._state == "between" and char == "]":
                self._state, text = "after", head[1:]
            elif self._state == "between" and char == "{":
                self._state = "element"
                self._element, self._element_end = CallObjectStream("parameters"), JsonValueEnd()
                self._element_text = ""
            else:  # not the expected array structure: keep it as content
                self._content(text)
                self._state = "after"
                return

    def _element_piece(self, text: str) -> str:
        """Feed the current element; returns the text after it, if it ended."""
        end = self._element_end.feed(text)
        piece, rest = (text, "") if end is None else (text[:end], text[end:])
        self._element_text += piece
        name, arguments = self._element.feed(piece)
        if name is not None:
            self._start_call(name)
        self._add_arguments(arguments)
        if end is not None:
            self._close_element()
            self._state = "between"
        return rest

    def _finish(self) -> None:
        if self._state == "element":
            self._close_element()

    def _close_element(self) -> None:
        if self._element.committed:
            return
        whole = parse_whole_call(self._element_text, "parameters")
        if whole is None:
            self._content(self._element_text)
        else:
            self._start_call(whole[0])
            self._add_arguments(whole[1])

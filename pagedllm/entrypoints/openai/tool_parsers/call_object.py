"""Streaming one call object, ``{"name": "f", "arguments": {...}}``, as it is generated.

Once the text so far reads ``{"name": "<name>", "<arguments key>": {`` the call is
committed: its name is known and the arguments object's text is passed on as it
arrives, up to the brace that closes it (found by tracking JSON nesting, strings
and escapes). The arguments are the model's own JSON text, unchanged: as OpenAI
says of its own tool calls, they may be invalid JSON (cut by ``max_tokens``), so
clients should validate them. Objects written in another key order are decided
when they are complete (``parse_whole_call``).
"""

from __future__ import annotations

import json
import re
from typing import Any


class JsonValueEnd:
    """Finds where a JSON object or array that starts at the first character fed ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the value's closing bracket, or None if it is still open."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return None


class CallObjectStream:
    """The name and the arguments' text of one call object, as its text arrives."""

    def __init__(self, arguments_key: str) -> None:
        self.arguments_key = arguments_key
        self._prefix = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"'
                                  + re.escape(arguments_key) + r'"\s*:\s*(?=\{)')
        self._head = ""  # the text before the commit
        self.name: str | None = None
        self._arguments_end = JsonValueEnd()

    @property
    def committed(self) -> bool:
        return self.name is not None

    def feed(self, text: str) -> tuple[str | None, str]:
        """Returns (the name, when this text commits the call; the new arguments text)."""
        if self._arguments_end.done:
            return None, ""
        if self.committed:
            return None, self._arguments(text)
        self._head += text
        match = self._prefix.match(self._head)
        if match is None:
            return None, ""
        self.name = json.loads(match.group(1))
        return self.name, self._arguments(self._head[match.end():])

    def _arguments(self, text: str) -> str:
        end = self._arguments_end.feed(text)
        return text if end is None else text[:end]


def parse_whole_call(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object in any key order, or None
    if ``text`` is not one (then it is not a call)."""
    try:
        call: Any = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)

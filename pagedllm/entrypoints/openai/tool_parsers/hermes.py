"""The Hermes / Qwen tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the blocks is content (text before the first call stays content).
A block whose JSON is not a call (malformed, no name, arguments not an object)
stays content, tags and all, so nothing the model wrote is lost. While
streaming, text that may be the start of ``<tool_call>`` is held back, so a
block's text never leaks into content deltas; a block that starts like a call
(``{"name": "f", "arguments": {``) streams its arguments as they come. With
``max_calls`` (``parallel_tool_calls: false`` gives 1) the text after that many
calls is all content.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallRecord
from pagedllm.entrypoints.openai.tool_parsers.call_object import CallObjectStream, parse_whole_call

START, END = "<tool_call>", "</tool_call>"


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class HermesToolParser(ToolCallRecord):
    """Incremental parser of one choice's output (see ``ToolCallRecord``)."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self._max_calls = max_calls
        self._held = ""  # text not yet decided (a possible tag start, or the current block)
        self._block: CallObjectStream | None = None  # set while inside <tool_call>
        self._body = ""  # the current block's body so far

    def _parse(self, text: str) -> None:
        self._held += text
        while True:
            if self._block is None:
                looking = len(self.calls) != self._max_calls  # after max_calls calls, the rest is content
                at = self._held.find(START) if looking else -1
                if at < 0:
                    keep = _partial_tag_length(self._held, START) if looking else 0
                    self._content(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    return
                self._content(self._held[:at])
                self._held = self._held[at + len(START):]
                self._block, self._body = CallObjectStream("arguments"), ""
            at = self._held.find(END)
            if at < 0:
                keep = _partial_tag_length(self._held, END)
                self._block_text(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                return
            self._block_text(self._held[:at])
            self._held = self._held[at + len(END):]
            self._close_block(closed=True)

    def _finish(self) -> None:
        if self._block is None:
            self._content(self._held)
        else:
            self._block_text(self._held)
            self._close_block(closed=False)
        self._held = ""

    def _block_text(self, text: str) -> None:
        self._body += text
        name, arguments = self._block.feed(text)
        if name is not None:
            self._start_call(name)
        self._add_arguments(arguments)

    def _close_block(self, closed: bool) -> None:
        """A committed call is done (if the output ended inside it, its arguments
        are what was generated). Otherwise the whole body decides: a call, or content."""
        block, self._block = self._block, None
        if block.committed:
            return
        whole = parse_whole_call(self._body, "arguments")
        if whole is None:
            self._content(START + self._body + (END if closed else ""))
            return
        self._start_call(whole[0])
        self._add_arguments(whole[1])

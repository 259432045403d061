"""How much of each choice's text and tokens a stream has sent: the one rule of
what a chunk may carry, shared by chat and completions streams."""

from __future__ import annotations

from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams


class TextCursor:
    """Per choice index: the characters and tokens already streamed."""

    def __init__(self, params: SamplingParams) -> None:
        # Hold back what could still become a stop string (which is cut from the text).
        self.hold_back = max((len(s) for s in params.stop_strings), default=1) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}

    def begin(self, index: int) -> bool:
        """Marks the choice as begun; True the first time."""
        if index in self.sent_text:
            return False
        self.sent_text[index] = 0
        return True

    def new_text(self, index: int, completion: CompletionOutput) -> tuple[int, str] | None:
        """(where the new text starts, the new text) for the choice, advancing past it;
        None when there is nothing to send yet (a finished choice always sends)."""
        done = completion.finish_reason is not None
        text = completion.text
        visible = len(text) if done else max(0, len(text) - self.hold_back)
        while not done and visible and text[visible - 1] == "\ufffd":  # a partial UTF-8 character
            visible -= 1
        start = self.sent_text.get(index, 0)
        if visible <= start and not done:
            return None
        self.sent_text[index] = max(start, visible)
        return start, text[start:max(start, visible)]

    def new_tokens(self, index: int, completion: CompletionOutput) -> int:
        """The first of the choice's tokens not sent yet; all of them count as sent now."""
        first = self.sent_tokens.get(index, 0)
        self.sent_tokens[index] = len(completion.token_ids)
        return first

"""Reasoning output (``--reasoning-parser``): the thinking a reasoning model
writes between ``<think>`` and ``</think>`` goes apart from its answer, into
chat's ``reasoning_content``, the Responses API's reasoning items and the
Messages API's ``thinking`` blocks.

Two parsers, both on the ``<think>``/``</think>`` tags (each must be one token
of the vocabulary, so the engine can tell where the thinking ends):

- ``deepseek_r1``: the output starts inside the thinking (DeepSeek-R1's template
  opens it; a leading ``<think>`` the model writes itself is dropped), up to
  ``</think>``; an output cut before it is all thinking.
- ``qwen3``: thinking only when the prompt opened it (a thinking-only template)
  or the output starts with ``<think>``; otherwise all of it is the answer.

For both, a prompt that ends with a closed, empty thinking block (Qwen3's
template under ``chat_template_kwargs: {"enable_thinking": false}``) makes the
whole output the answer.

The answer alone is what tool-call parsing reads and what a grammar constrains
(``ReasoningGate``): a JSON schema or a forced tool call starts after the thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import ReasoningGate

START_TAG, END_TAG = "<think>", "</think>"
# Parser name -> whether an output starts inside the thinking when the prompt says nothing.
REASONING_PARSERS: dict[str, bool] = {"deepseek_r1": True, "qwen3": False}


@dataclass(frozen=True)
class ReasoningSettings:
    """A server's reasoning parser over its tokenizer (built once, when the engine loads)."""

    name: str
    start_token_id: int
    end_token_id: int
    thinking_by_default: bool

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> ReasoningSettings:
        """Raises ``ValueError`` for an unknown parser, or a vocabulary where a tag is not one token."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
        ids = []
        for tag in (START_TAG, END_TAG):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"--reasoning-parser {name}: this model's tokenizer splits {tag!r} into "
                                 f"{len(encoded)} tokens; it is not a reasoning model of that family")
            ids.append(encoded[0])
        return cls(name, ids[0], ids[1], REASONING_PARSERS[name])

    def starts_thinking(self, prompt_text: str) -> bool | None:
        """Whether the output of ``prompt_text`` starts inside the thinking: True,
        False (the prompt closed it), or None (the model may open it with ``<think>``)."""
        tail = prompt_text.rstrip()
        if tail.endswith(END_TAG):
            return False
        if tail.rfind(START_TAG) > tail.rfind(END_TAG):
            return True
        return True if self.thinking_by_default else None

    def gate(self, starts_thinking: bool | None) -> ReasoningGate | None:
        """What holds a grammar back until the thinking ends (None: it applies from the first token)."""
        if starts_thinking is False:
            return None
        return ReasoningGate(self.start_token_id, self.end_token_id, thinking=bool(starts_thinking))


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one output's text, fed piece by piece, into thinking and answer.

    Text that may still become a tag (``"</thi"``) is held back until the next
    piece or ``finish``, so a stream and a whole response split alike. The
    whitespace between ``</think>`` and the answer belongs to neither.
    """

    def __init__(self, starts_thinking: bool | None) -> None:
        # At the start a leading <think> opens (or, when already inside, repeats) the thinking;
        # after a prompt that closed it, the whole output is the answer.
        self._opening = starts_thinking is not False
        self._thinking = bool(starts_thinking)
        self._strip_answer = False  # just after </think>: drop the answer's leading whitespace
        self._held = ""
        self.reasoning_parts: list[str] = []
        self.thinking_seen = bool(starts_thinking)

    def feed(self, text: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        text = self._held + text
        self._held = ""
        if self._opening:
            stripped = text.lstrip()
            if stripped.startswith(START_TAG):
                self._thinking = self.thinking_seen = True
                text, self._opening = stripped[len(START_TAG):], False
            elif START_TAG.startswith(stripped):  # could still become <think>: wait
                self._held = text
                return delta
            else:
                self._opening = False
        if self._thinking:
            end = text.find(END_TAG)
            if end < 0:
                keep = _partial_tag_length(text, END_TAG)
                self._held = text[len(text) - keep:] if keep else ""
                delta.reasoning = text[:len(text) - keep]
                self.reasoning_parts.append(delta.reasoning)
                return delta
            delta.reasoning = text[:end]
            self.reasoning_parts.append(delta.reasoning)
            self._thinking, self._strip_answer = False, True
            text = text[end + len(END_TAG):]
        if self._strip_answer:
            text = text.lstrip()
            self._strip_answer = not text
        delta.content = text
        return delta

    def finish(self) -> ReasoningDelta:
        """What is still held back, once the output ended."""
        held, self._held = self._held, ""
        if self._thinking:
            self.reasoning_parts.append(held)
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held if not self._strip_answer else held.lstrip())

    def take(self, text: str, finished: bool) -> ReasoningDelta:
        """``feed(text)``, and when the output ``finished`` what ``finish`` releases too."""
        delta = self.feed(text)
        if finished:
            end = self.finish()
            delta.reasoning += end.reasoning
            delta.content += end.content
        return delta

    @property
    def reasoning(self) -> str | None:
        """All the thinking so far (None when the output had none)."""
        return "".join(self.reasoning_parts) if self.thinking_seen else None


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0

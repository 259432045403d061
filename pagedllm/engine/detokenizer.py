"""Incremental detokenization: each step decodes a few tokens, not the whole output.

Decoding all output ids every step costs O(length) per token, O(length^2) per
request. Instead (vLLM's scheme) each sequence keeps two offsets into its ids:
``prefix_offset`` .. ``read_offset`` is a short window of tokens already turned
into text, decoded again only as context. The new text is
decode(window + new ids) minus decode(window): the context makes tokenizers
that drop a leading space at the start of a decode (SentencePiece) or merge
bytes across tokens agree with a full decode. While the new ids end in an
incomplete UTF-8 character (decoded as U+FFFD), nothing is emitted and the
offsets stay put until the character completes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokenizerState:
    """The offsets of one sequence; ``text`` is everything emitted so far."""

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokenizerState,
                             skip_special_tokens: bool) -> str:
    """Advance ``state`` over ``token_ids`` (all of the sequence's output ids so
    far, grown since the last call); returns the newly emitted text."""
    if state.read_offset >= len(token_ids):
        return ""
    prefix_text = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        # Nothing printable yet (a special token skipped, or half a character).
        return ""
    new_text = full_text[len(prefix_text) :]
    state.text += new_text
    state.prefix_offset = state.read_offset
    state.read_offset = len(token_ids)
    return new_text

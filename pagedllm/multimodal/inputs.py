"""What a request carries per image, as plain data: the scheduler and the block
hashes see only the placeholder range and the content hash; the processed pixel
tensors ride along opaquely (``data``) to the model runner, which alone reads them.
No torch import here: ``core/`` names these types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions ``[offset, offset + length)`` an image's expansion spans,
    from its first to its last placeholder token (tile markers between them included)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One image of one prompt.

    ``identifier`` is the image's content hash (``multimodal.hashing``): the key of
    its blocks' hashes and of the encoder cache. The encoder's output rows go, in
    order, to the positions of ``placeholder`` whose token is ``embed_token_id``
    (``num_embeds`` of them); the other tokens there (tile markers) keep their own
    embeddings. ``data`` is the processor's output for this image alone (the
    family's model reads it in ``embed_image``). ``attends_both_ways``: the model
    attends both ways over each run of the image's tokens (Gemma 3), so a prefill
    chunk never ends inside its placeholder range (``Request.whole_spans``)."""

    modality: str
    identifier: str
    placeholder: PlaceholderRange
    embed_token_id: int
    num_embeds: int
    data: Any = None
    attends_both_ways: bool = False

    @property
    def span(self) -> tuple[int, int, str]:
        """(offset, length, identifier): all the block hashes need (``core/block_hash.py``)."""
        return (self.placeholder.offset, self.placeholder.length, self.identifier)

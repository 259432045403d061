"""The attention backend interface and the metadata it is handed each step.

The model runner builds one :class:`AttentionMetadata` per forward pass and
passes it explicitly down through every layer (no module-global state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.attention.kv_cache import LayerKVCache


@dataclass
class PrefillSpan:
    """A run of ``query_len`` new tokens of one sequence, stored at
    ``query[query_start : query_start + query_len]``, whose context after this
    step holds ``context_len`` tokens (``context_len > query_len`` when earlier
    tokens are already in the pool: a later prefill chunk or a cached prefix)."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_this_sequence] int64
    # With full-precision tails (``kv_cache``): the tail slot holding the tokens of
    # the span's first block before the span (-1: none, or the span starts a block).
    tail_slot: int = -1
    # Sequence positions [start, end) of runs of image tokens that attend to each other both
    # ways (Gemma 3), of the images the span's queries touch; the scheduler keeps each whole
    # in one chunk, so every key such a query reads is in the pool or the span.
    image_groups: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each query reads.

    Token layout of the batch: the first ``num_decodes`` tokens are decodes
    (one new token per sequence), then the prefill spans back to back.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: pool slot of each new token's K/V
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64, including the new token
    prefills: list[PrefillSpan]
    # Full-precision tails of an int8 pool (``kv_cache``'s reading rule; None: no
    # tails, every key is read from the pool as stored). Tokens ``tail_write_rows``
    # also go to tail positions ``tail_write_slots`` (tail slot * block_size +
    # offset); decode row i reads its own block from tail slot
    # ``decode_tail_slots[i]`` (-1: from the pool, as at a block's last position).
    tail_write_rows: torch.Tensor | None = None
    tail_write_slots: torch.Tensor | None = None
    decode_tail_slots: torch.Tensor | None = None
    # A hybrid KV layout (``core.kv_groups``, more than one group): view g holds
    # group g's slot_mapping, decode_block_tables and spans' block tables, and
    # shares everything else with this metadata (view 0 is this metadata). None:
    # one group, every layer reads this metadata.
    group_views: list[AttentionMetadata] | None = None

    def for_cache(self, kv_cache: LayerKVCache) -> AttentionMetadata:
        """The metadata ``kv_cache``'s layer reads: its group's view (itself with one group)."""
        views = self.group_views
        return self if views is None else views[kv_cache.group]

    def reads_tails(self, kv_cache: LayerKVCache) -> bool:
        """Whether this step applies the tail reading rule to ``kv_cache`` (a
        speculative draft's pool has no tails even when the target's has)."""
        return kv_cache.has_tails and self.tail_write_rows is not None


class AttentionBackend(Protocol):
    """Paged attention: write this step's K/V into the pool, then attend.

    Shapes: ``query`` [num_tokens, num_heads, head_dim]; ``key``/``value``
    [num_tokens, num_kv_heads, head_dim]; ``kv_cache`` is the layer's
    :class:`~pagedllm.attention.kv_cache.LayerKVCache` (block-major
    [num_blocks, block_size, num_kv_heads, head_dim] K and V, plus per-token
    scales when quantized). Returns [num_tokens, num_heads, head_dim].
    Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Per-layer options (Hugging Face's conventions, so models match it):
    ``sliding_window`` W: a query at position p sees only keys at positions
    p - W < j <= p (Mistral, Gemma's local layers); ``logits_soft_cap`` c: scores
    (after ``scale``) become c * tanh(score / c) before the softmax (Gemma 2);
    ``attention_chunk`` C: a query at position p sees only keys at positions
    floor(p / C) * C <= j <= p, its own C-token chunk (Llama 4's chunked local layers);
    ``sinks`` [num_heads]: a learned logit per query head that joins the softmax's
    denominator and weighs no value (gpt-oss's attention sinks): head h's weights are
    exp(s_j) / (exp(sinks[h]) + sum_i exp(s_i)), so they sum to less than one.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attention_chunk: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

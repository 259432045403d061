"""Portable paged attention in plain PyTorch (CPU first, runs anywhere).

Decodes are batched: each sequence's K/V is gathered through its block table
into a padded [batch, max_context] view and masked past its length. Prefill
spans run one sequence at a time; a span with no earlier context attends to
its own fresh K/V directly and never touches the pool on the read side.
A windowed or chunked layer's reads start at the first block of its queries' window
or chunk: the table entries before it may have been released (``core/kv_managers/``).
The decode kernels mask by window only, and only the C++ one reads attention sinks: a
chunked layer's decodes, and a layer with sinks (gpt-oss) on the Triton kernel, gather here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache

# (query, layer cache, block_tables, context_lens, scale, sliding_window, logits_soft_cap, tail_slots[, sinks])
# -> output; sinks only to a kernel that reads them (``TorchPagedAttention``'s decode_reads_sinks).
DecodeKernel = Callable[..., torch.Tensor]

# (query [queries, heads, dim], key, value [keys, kv_heads, dim], scale, query_offset) -> [queries, heads, dim]:
# causal attention where query i sees keys j <= i + query_offset.
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


class TorchPagedAttention:
    """The CPU / portable :class:`~pagedllm.attention.backend.AttentionBackend`.

    With a ``decode_kernel`` (the C++ CPU kernel or the Triton GPU kernel,
    chosen by :func:`pagedllm.attention.selector.paged_decode_kernel_for`)
    decodes read K/V straight through the block tables instead of gathering a
    padded copy. The kernel takes
    ``(query, kv_cache, block_tables, context_lens, scale, sliding_window,
    logits_soft_cap, tail_slots)``, reads no table entry before the window's first block,
    reads row i's last block from tail slot ``tail_slots[i]`` when that is >= 0
    (``tail_slots`` None: no tails; the selector only gives pools with tails to
    kernels that read them), must accept
    tensors on the device the pool lives on and the pool's storage type
    (the selector only picks kernels that do), reads a quantized pool's values
    as stored (it is given the query in the pool's rotated basis, and its
    output is rotated back), and must accept a query whose
    rows are strided (a view into the fused qkv output) as long as each row's
    heads and dims are packed.

    Prefill spans use PyTorch's SDPA, or a ``prefill_kernel`` (the selector's
    :func:`~pagedllm.attention.selector.prefill_kernel_for`) for the spans of
    plain causal layers (no window, no soft cap, no sinks) that read no full-precision
    tails. A layer with a soft cap or sinks attends eagerly, as Hugging Face does (SDPA has neither). It takes ``(query, key, value, scale, query_offset)``, query
    [queries, heads, dim] and key/value [keys, kv_heads, dim] whose rows may be
    strided as long as each row's dims are packed, in the dtype the selector
    chose it for, and returns [queries, heads, dim] where query i attends to
    keys j <= i + query_offset.
    """

    def __init__(self, decode_kernel: DecodeKernel | None = None,
                 prefill_kernel: PrefillKernel | None = None, decode_reads_sinks: bool = False) -> None:
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.decode_reads_sinks = decode_reads_sinks

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
    ) -> torch.Tensor:
        layer = _LayerOptions(scale, sliding_window, logits_soft_cap, attention_chunk, sinks)
        # Every read sees what the pool holds: with a quantized pool a prompt's
        # own fresh K/V come back rounded exactly as stored, so a prefix-cache hit
        # (which reads them from the pool) gives the same result as a recompute.
        # Decodes read only the pool, so a pure decode step needs nothing back.
        tails = metadata.reads_tails(kv_cache)
        # A span's earlier tokens in its first block, read before this step's tail
        # writes: a span that leaves that block hands its slot on to its last one.
        earlier = [self._earlier_tail(kv_cache, span, query.dtype) for span in metadata.prefills] if tails else None
        fresh_key, fresh_value = key, value
        key, value = kv_cache.write(key, value, metadata.slot_mapping, read_back=bool(metadata.prefills),
                                    tail_rows=metadata.tail_write_rows if tails else None,
                                    tail_slots=metadata.tail_write_slots if tails else None)
        tail_slots = metadata.decode_tail_slots if tails else None
        num_decodes = metadata.num_decodes
        if not metadata.prefills:
            # A pure decode step: the decode output is the whole output, no copy.
            return self._decode(query, kv_cache, metadata, layer, tail_slots)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, metadata, layer, tail_slots)
        for i, span in enumerate(metadata.prefills):
            rows = slice(span.query_start, span.query_start + span.query_len)
            full = None
            if tails:
                # The full-precision keys its queries may read: the earlier ones, then
                # the span's own as a tail holds them.
                earlier_key, earlier_value = earlier[i]
                full = (torch.cat((earlier_key, kv_cache.as_tail_holds(fresh_key[rows]))),
                        torch.cat((earlier_value, kv_cache.as_tail_holds(fresh_value[rows]))))
            output[rows] = self._prefill(query[rows], key[rows], value[rows], kv_cache, span, layer, full)
        return output

    @staticmethod
    def _earlier_tail(kv_cache: LayerKVCache, span, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, kv_heads, dim] K and V of the n = first % block_size tokens of the
        span's first block before it, from its tail slot (none without one)."""
        block_size = kv_cache.key.shape[1]
        n = (span.context_len - span.query_len) % block_size if span.tail_slot >= 0 else 0
        if not n:
            empty = kv_cache.key.new_empty((0, *kv_cache.key.shape[2:]), dtype=dtype)
            return empty, empty
        slot = torch.tensor([span.tail_slot], dtype=torch.long, device=kv_cache.key.device)
        keys, values = kv_cache.gather_tails(slot, dtype)
        return keys[0, :n], values[0, :n]

    def _decode(self, query, kv_cache: LayerKVCache, metadata: AttentionMetadata, layer: _LayerOptions,
                tail_slots: torch.Tensor | None = None) -> torch.Tensor:
        if self.decode_kernel is not None and layer.attention_chunk is None and \
                (layer.sinks is None or self.decode_reads_sinks):
            # A quantized pool stores K/V rotated (see ``kv_cache``; its tails too):
            # the kernel reads them as stored, given the query in that basis.
            sinks = () if layer.sinks is None else (layer.sinks,)
            out = self.decode_kernel(kv_cache.in_storage_basis(query), kv_cache, metadata.decode_block_tables,
                                     metadata.decode_context_lens, layer.scale, layer.sliding_window,
                                     layer.logits_soft_cap, tail_slots, *sinks)
            return kv_cache.in_storage_basis(out)
        return self._gather_decode(query, kv_cache, metadata, layer, tail_slots)

    @staticmethod
    def _gather_decode(query, kv_cache: LayerKVCache, metadata: AttentionMetadata, layer: _LayerOptions,
                       tail_slots: torch.Tensor | None = None) -> torch.Tensor:
        tables = metadata.decode_block_tables
        context_lens = metadata.decode_context_lens[:, None]
        first = torch.zeros_like(context_lens)  # each row's first table entry read
        block_size = kv_cache.key.shape[1]
        reach = layer.reach
        first_position = layer.first_read(context_lens - 1).clamp(min=0)  # each row's first key
        if reach is not None:
            # The blocks a window or chunk can straddle, from each row's first one read;
            # an index past the table re-reads its last entry, masked below.
            first = first_position // block_size
            span = min(tables.shape[1], (reach + block_size - 2) // block_size + 1)
            index = first + torch.arange(span, device=tables.device)
            tables = tables.gather(1, index.clamp(max=max(tables.shape[1] - 1, 0)))
        keys, values = kv_cache.gather(tables, query.dtype)
        if tail_slots is not None:
            # A row with a tail reads its own block from it (tokens past it are masked below).
            rows = (tail_slots >= 0).nonzero().squeeze(1)
            if rows.numel():
                tail_keys, tail_values = kv_cache.gather_tails(tail_slots[rows], query.dtype)
                start = ((context_lens[rows, 0] - 1) // block_size - first[rows, 0]) * block_size
                index = start[:, None] + torch.arange(block_size, device=query.device)
                keys[rows[:, None], :, index] = tail_keys  # both [n, block_size, kv_heads, dim]
                values[rows[:, None], :, index] = tail_values
        positions = first * block_size + torch.arange(keys.shape[2], device=query.device)
        # [batch, 1, 1, keys]: key j is visible iff j < context_len (and in the window or chunk).
        mask = (positions < context_lens) & (positions >= first_position)
        # The padding holds slots never written (the pool is uninitialised): a NaN
        # there would survive the mask (-inf + NaN, 0 * NaN), so it is replaced, not weighted.
        hidden = ~mask[:, None, :, None]
        keys.masked_fill_(hidden, 0)
        values.masked_fill_(hidden, 0)
        return _attend(query.unsqueeze(2), keys, values, mask[:, None, None, :], layer).squeeze(2)

    def _prefill(self, query, key, value, kv_cache: LayerKVCache, span, layer: _LayerOptions,
                 full: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One span; ``full``: when the pool's tails apply (``kv_cache``'s reading
        rule), the full-precision K/V of its first block's earlier tokens and of
        its own, else None."""
        # Query i sits at position first + i and sees keys up to it (and in the window or chunk).
        first = span.context_len - span.query_len
        if full is not None and span.image_groups:
            raise ValueError("an int8 KV pool with full-precision tails does not take images the model attends both "
                             "ways (Gemma 3); use kv_cache_dtype='auto' for this model")
        if self.prefill_kernel is not None and layer.is_plain and full is None and not span.image_groups:
            if first:  # earlier tokens: the span's keys are the pool's, from position 0
                gathered = kv_cache.gather(span.block_table.unsqueeze(0), query.dtype)
                key, value = (t[0, :, : span.context_len].transpose(0, 1) for t in gathered)
            return self.prefill_kernel(query, key, value, layer.scale, first)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
        key_start = 0  # position of the first key read
        if span.context_len == span.query_len:
            k = key.transpose(0, 1).unsqueeze(0)
            v = value.transpose(0, 1).unsqueeze(0)
        else:
            block_size = kv_cache.key.shape[1]
            key_start = max(0, layer.first_read(first)) // block_size * block_size
            k, v = kv_cache.gather(span.block_table[key_start // block_size :].unsqueeze(0), query.dtype)
            k, v = k[:, :, : span.context_len - key_start], v[:, :, : span.context_len - key_start]
        if full is not None:
            out = _attend_with_tails(q, k, v, key_start, full, kv_cache.key.shape[1], span, layer)
        elif span.context_len == span.query_len and layer.is_plain and not span.image_groups:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=True)
        else:
            q_pos = torch.arange(first, span.context_len, device=query.device)[:, None]
            k_pos = torch.arange(key_start, span.context_len, device=query.device)[None, :]
            out = _attend(q, k, v, _visible(q_pos, k_pos, layer, span.image_groups), layer)
        return out.squeeze(0).transpose(0, 1)


@dataclass(frozen=True)
class _LayerOptions:
    """One layer's attention options (see ``AttentionBackend.forward``)."""

    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    attention_chunk: int | None = None
    sinks: torch.Tensor | None = None  # [heads]: gpt-oss's per-head logit in the denominator

    @property
    def is_plain(self) -> bool:
        return self.reach is None and self.logits_soft_cap is None and self.sinks is None

    @property
    def reach(self) -> int | None:
        """The most keys a query reads (its window or chunk; None: every earlier one)."""
        return self.sliding_window if self.sliding_window is not None else self.attention_chunk

    def first_read(self, position):
        """The first key position a query at ``position`` (an int or a tensor) reads;
        below 0 (callers clamp) when a window reaches back past the sequence's start."""
        if self.sliding_window is not None:
            return position - self.sliding_window + 1
        if self.attention_chunk is not None:
            return position // self.attention_chunk * self.attention_chunk
        return position * 0


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, layer: _LayerOptions,
             image_groups: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """[queries, keys]: causal or inside one of ``image_groups`` both ways, and within the
    layer's window or chunk (Hugging Face's Gemma 3 mask: AND(window, OR(causal, same image)))."""
    mask = k_pos <= q_pos
    for start, end in image_groups:
        mask = mask | ((q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end))
    if layer.reach is not None:
        mask &= k_pos >= layer.first_read(q_pos)
    return mask


# Queries per attention call of a prefill under the tail rule: a call reads the int8 keys up
# to its last query and the full-precision keys of its own blocks, so a span costs about a
# causal attention plus this many keys per query, not twice its keys for every query.
_TAIL_QUERY_CHUNK = 128


def _attend_with_tails(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: int,
                       full: tuple[torch.Tensor, torch.Tensor], block_size: int, span,
                       layer: _LayerOptions) -> torch.Tensor:
    """A prefill span's attention under the tail reading rule (``kv_cache``): a
    query at p, unless p is its block's last position, reads the keys of its
    own block at full precision, every other key as int8. ``k``/``v``: the
    int8 keys from ``key_start``; ``full``: [n, kv_heads, dim] full-precision
    K/V of the span's last n positions. Each block-aligned run of queries
    attends to its int8 keys and its blocks' full-precision keys side by side,
    the mask choosing exactly one copy of each key per query."""
    full_start = span.context_len - full[0].shape[0]
    full_keys, full_values = (t.transpose(0, 1).unsqueeze(0) for t in full)
    first = span.context_len - span.query_len
    chunk = max(1, _TAIL_QUERY_CHUNK // block_size) * block_size
    device = q.device
    outputs = []
    start = first
    while start < span.context_len:
        end = min(span.context_len, (start // chunk + 1) * chunk)
        q_pos = torch.arange(start, end, device=device)[:, None]
        k_pos = torch.arange(key_start, end, device=device)[None, :]
        full_from = max(full_start, start // block_size * block_size)
        f_pos = torch.arange(full_from, end, device=device)[None, :]
        reads_full = q_pos % block_size != block_size - 1
        q_block = q_pos // block_size
        mask = _visible(q_pos, k_pos, layer) & ~(reads_full & (k_pos // block_size == q_block) & (k_pos >= full_start))
        full_mask = reads_full & (f_pos // block_size == q_block) & _visible(q_pos, f_pos, layer)
        keys = torch.cat((k[:, :, : end - key_start], full_keys[:, :, full_from - full_start : end - full_start]), 2)
        values = torch.cat((v[:, :, : end - key_start], full_values[:, :, full_from - full_start : end - full_start]), 2)
        outputs.append(_attend(q[:, :, start - first : end - first], keys, values, torch.cat((mask, full_mask), 1),
                               layer))
        start = end
    return torch.cat(outputs, dim=2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            layer: _LayerOptions) -> torch.Tensor:
    """Masked attention, q [b, heads, n, d] over k/v [b, kv_heads, m, d].
    SDPA has no soft cap and no sinks, so such layers take Hugging Face's eager path:
    scores in the input dtype, capped, masked, each head's sink logit appended as one
    more column, softmax in fp32, the sink's column dropped, cast back. A layer with sinks
    computes all of it in fp32 and rounds once, as the C++ decode kernel does."""
    if layer.logits_soft_cap is None and layer.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    dtype = q.dtype
    if layer.sinks is not None:
        # The C++ decode kernel's precision (fp32, rounded once), so that a sequence's
        # prefill and decodes agree in bf16 too.
        q, k, v = q.float(), k.float(), v.float()
    scores = q @ k.transpose(-1, -2) * layer.scale
    cap = layer.logits_soft_cap
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        sinks = layer.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sinks), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if layer.sinks is not None:
        probs = probs[..., :-1]
    return (probs.to(q.dtype) @ v).to(dtype)

"""Portable paged attention in plain PyTorch (CPU first, runs anywhere).

Decodes are batched: each sequence's K/V is gathered through its block table
into a padded [batch, max_context] view and masked past its length. Prefill
spans run one sequence at a time; a span with no earlier context attends to
its own fresh K/V directly and never touches the pool on the read side.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def write_to_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token i's K/V at pool slot ``slot_mapping[i]`` (block * block_size + offset)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_from_cache(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, num_kv_heads, max_blocks * block_size, head_dim]."""
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


class TorchPagedAttention:
    """The CPU / portable :class:`~pagedllm.attention.backend.AttentionBackend`.

    With a ``decode_kernel`` (the C++ CPU kernel or the Triton GPU kernel,
    chosen by :func:`pagedllm.attention.selector.paged_decode_kernel_for`)
    decodes read K/V straight through the block tables instead of gathering a
    padded copy; prefill spans always use PyTorch's SDPA. The kernel takes
    ``(query, key_cache, value_cache, block_tables, context_lens, scale)``,
    must accept tensors on the device the pool lives on, and must accept a
    query whose rows are strided (a view into the fused qkv output) as long as
    each row's heads and dims are packed.
    """

    def __init__(self, decode_kernel: DecodeKernel | None = None) -> None:
        self.decode_kernel = decode_kernel

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_to_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        num_decodes = metadata.num_decodes
        if not metadata.prefills:
            # A pure decode step: the decode output is the whole output, no copy.
            return self._decode(query, key_cache, value_cache, metadata, scale)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], key_cache, value_cache, metadata, scale)
        for span in metadata.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            output[rows] = self._prefill(query[rows], key[rows], value[rows], key_cache, value_cache, span, scale)
        return output

    def _decode(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.decode_kernel is not None:
            return self.decode_kernel(
                query, key_cache, value_cache,
                metadata.decode_block_tables, metadata.decode_context_lens, scale,
            )
        return self._gather_decode(query, key_cache, value_cache, metadata, scale)

    @staticmethod
    def _gather_decode(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        block_tables = metadata.decode_block_tables
        keys = gather_from_cache(key_cache, block_tables)
        values = gather_from_cache(value_cache, block_tables)
        positions = torch.arange(keys.shape[2], device=query.device)
        # [batch, 1, 1, max_context]: key j is visible iff j < context_len.
        mask = (positions[None, :] < metadata.decode_context_lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(query, key, value, key_cache, value_cache, span, scale: float) -> torch.Tensor:
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
        if span.context_len == span.query_len:
            k = key.transpose(0, 1).unsqueeze(0)
            v = value.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            table = span.block_table.unsqueeze(0)
            k = gather_from_cache(key_cache, table)[:, :, : span.context_len]
            v = gather_from_cache(value_cache, table)[:, :, : span.context_len]
            # Query i sits at position context_len - query_len + i and sees keys up to it.
            first = span.context_len - span.query_len
            q_pos = torch.arange(first, span.context_len, device=query.device)
            k_pos = torch.arange(span.context_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

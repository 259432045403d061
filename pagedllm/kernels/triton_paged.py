"""Paged decode attention in Triton, for the GPU path.

One program per (sequence, query head) walks the sequence's block table one
block at a time with an online softmax, so no padded copy of the context is
ever made (the same contract as the C++ CPU kernel in ``csrc/paged_decode.cpp``).

Triton is optional: ``triton_paged_decode_available()`` is False when it is
not installed, and callers keep the PyTorch gather path. Under
``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs
on CPU tensors through Triton's interpreter, which is how the tests check it
on machines without a GPU.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the engine uses the PyTorch decode path
    triton = None


def triton_paged_decode_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
        block_tables_ptr, context_lens_ptr,
        scale,
        stride_q_token, stride_q_head,
        stride_o_token, stride_o_head,
        stride_c_block, stride_c_slot, stride_c_head,
        stride_table_row,
        NUM_KV_HEADS: tl.constexpr,
        QUANTIZED: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // QUERIES_PER_KV
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_ok = dims < HEAD_DIM
        slots = tl.arange(0, BLOCK_SIZE)

        q = tl.load(query_ptr + seq * stride_q_token + head * stride_q_head + dims, mask=dim_ok, other=0.0)
        q = q.to(tl.float32) * scale
        context_len = tl.load(context_lens_ptr + seq)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)

        # Running max starts finite so exp(m_old - m_new) never sees inf - inf.
        running_max = tl.full((), -1.0e30, tl.float32)
        running_sum = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM_PADDED,), tl.float32)
        for logical in range(0, num_blocks):
            block = tl.load(block_tables_ptr + seq * stride_table_row + logical).to(tl.int64)
            offsets = (block * stride_c_block + slots[:, None] * stride_c_slot
                       + kv_head * stride_c_head + dims[None, :])
            visible = (logical * BLOCK_SIZE + slots) < context_len
            load_mask = visible[:, None] & dim_ok[None, :]
            k = tl.load(key_cache_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)
            if QUANTIZED:
                # int8 pool: one fp32 scale per (slot, KV head) for K and for V.
                scale_offsets = (block * BLOCK_SIZE + slots) * NUM_KV_HEADS + kv_head
                scores = scores * tl.load(key_scale_ptr + scale_offsets, mask=visible, other=0.0)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max)
            v = tl.load(value_cache_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
            if QUANTIZED:
                v = v * tl.load(value_scale_ptr + scale_offsets, mask=visible, other=0.0)[:, None]
            acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
            running_sum = running_sum * correction + tl.sum(weights, axis=0)
            running_max = new_max
        result = acc / running_sum
        tl.store(out_ptr + seq * stride_o_token + head * stride_o_head + dims,
                 result.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.cache
def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence attends over its paged context.

    Shapes: ``query`` [num_seqs, num_heads, head_dim] (rows may be strided);
    caches [num_blocks, block_size, num_kv_heads, head_dim], contiguous, in the
    query's dtype or int8 with ``key_scale``/``value_scale`` fp32
    [num_blocks, block_size, num_kv_heads]; ``block_tables``
    [num_seqs, max_blocks] (entries past a sequence's context are never read);
    ``context_lens`` [num_seqs], each at least 1. The block size must be a
    power of two (Triton ranges are).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; use the PyTorch decode path")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two block_size, got {block_size}")
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("key_cache and value_cache must be contiguous")
    quantized = key_cache.dtype == torch.int8
    if quantized and (key_scale is None or value_scale is None):
        raise ValueError("an int8 pool needs key_scale and value_scale")
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_heads)](
        out, query, key_cache, value_cache,
        key_scale if quantized else key_cache, value_scale if quantized else value_cache,
        block_tables, context_lens,
        scale,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        QUANTIZED=quantized,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=_next_power_of_2(head_dim),
    )
    return out

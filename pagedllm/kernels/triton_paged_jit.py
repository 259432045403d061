"""The Triton JIT kernel behind ``pagedllm.kernels.triton_paged``.

A module of its own so that Triton is imported only when the kernel first
runs: ``triton_paged`` imports it lazily, and a CPU run never loads Triton
(whose import costs seconds and prints nanobind leak reports at exit).
Under ``TRITON_INTERPRET=1``, set before this module is imported, the kernel
runs on CPU tensors through Triton's interpreter. The ``@triton.jit`` helpers
below are inlined into the kernel when it compiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_scores(q, key_cache_ptr, key_scale_ptr, offsets, load_mask, visible, scale_offsets, soft_cap,
                  QUANTIZED: tl.constexpr, CAPPED: tl.constexpr):
    """One block's scores for one query head: q . k per slot (q carries the softmax
    scale), times the int8 pool's key scale, soft-capped; -inf where not visible."""
    k = tl.load(key_cache_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
    scores = tl.sum(k * q[None, :], axis=1)
    if QUANTIZED:
        scores = scores * tl.load(key_scale_ptr + scale_offsets, mask=visible, other=0.0)
    if CAPPED:
        # soft_cap * tanh(scores / soft_cap), with tanh(x) = 2 * sigmoid(2x) - 1.
        scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def _block_values(value_cache_ptr, value_scale_ptr, offsets, load_mask, visible, scale_offsets,
                  QUANTIZED: tl.constexpr):
    """One block's values [slots, head_dim] in fp32, times the int8 pool's value scale."""
    v = tl.load(value_cache_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
    if QUANTIZED:
        v = v * tl.load(value_scale_ptr + scale_offsets, mask=visible, other=0.0)[:, None]
    return v


@triton.jit
def paged_decode_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    block_tables_ptr, context_lens_ptr,
    scale, sliding_window, soft_cap,
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
    WINDOWED: tl.constexpr,
    CAPPED: tl.constexpr,
):
    # WINDOWED / CAPPED are compile-time, so a plain layer's kernel has no trace of either.
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
    # The window's first token (Hugging Face: keys p - W < j <= p); blocks before it are never read.
    first_token = tl.maximum(context_len - sliding_window, 0) if WINDOWED else 0

    # Running max starts finite so exp(m_old - m_new) never sees inf - inf.
    running_max = tl.full((), -1.0e30, tl.float32)
    running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM_PADDED,), tl.float32)
    for logical in range(first_token // BLOCK_SIZE, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_table_row + logical).to(tl.int64)
        offsets = (block * stride_c_block + slots[:, None] * stride_c_slot
                   + kv_head * stride_c_head + dims[None, :])
        visible = (logical * BLOCK_SIZE + slots) < context_len
        if WINDOWED:
            visible = visible & ((logical * BLOCK_SIZE + slots) >= first_token)
        load_mask = visible[:, None] & dim_ok[None, :]
        # int8 pool: one fp32 scale per (slot, KV head) for K and for V.
        scale_offsets = (block * BLOCK_SIZE + slots) * NUM_KV_HEADS + kv_head
        scores = _block_scores(q, key_cache_ptr, key_scale_ptr, offsets, load_mask, visible, scale_offsets,
                               soft_cap, QUANTIZED, CAPPED)
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)
        v = _block_values(value_cache_ptr, value_scale_ptr, offsets, load_mask, visible, scale_offsets, QUANTIZED)
        acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        running_max = new_max
    result = acc / running_sum
    tl.store(out_ptr + seq * stride_o_token + head * stride_o_head + dims,
             result.to(out_ptr.dtype.element_ty), mask=dim_ok)

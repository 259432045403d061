"""Paged decode attention in Triton, for the GPU path.

One program per (sequence, query head) walks the sequence's block table one
block at a time with an online softmax, so no padded copy of the context is
ever made (the same contract as the C++ CPU kernel in ``csrc/paged_decode.cpp``).

Triton is optional: ``triton_paged_decode_available()`` is False when it is
not installed, and callers keep the PyTorch gather path. Triton itself is
imported on the first kernel call (the kernel lives in ``triton_paged_jit``),
so CPU runs never load it. Under ``TRITON_INTERPRET=1`` (set before the first
call) the kernel runs on CPU tensors through Triton's interpreter, which is
how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def triton_paged_decode_available() -> bool:
    """Whether Triton is installed, checked without importing it."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_pool(key_cache: torch.Tensor, value_cache: torch.Tensor, key_scale: torch.Tensor | None,
                value_scale: torch.Tensor | None) -> bool:
    """Whether the pool is int8; ``ValueError`` for a pool the kernel cannot read."""
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two block_size, got {block_size}")
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("key_cache and value_cache must be contiguous")
    quantized = key_cache.dtype == torch.int8
    if quantized and (key_scale is None or value_scale is None):
        raise ValueError("an int8 pool needs key_scale and value_scale")
    return quantized


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One new token per sequence attends over its paged context.

    Shapes: ``query`` [num_seqs, num_heads, head_dim] (rows may be strided);
    caches [num_blocks, block_size, num_kv_heads, head_dim], contiguous, in the
    query's dtype or int8 with ``key_scale``/``value_scale`` fp32
    [num_blocks, block_size, num_kv_heads]; ``block_tables``
    [num_seqs, max_blocks] (entries past a sequence's context are never read);
    ``context_lens`` [num_seqs], each at least 1. The block size must be a
    power of two (Triton ranges are). ``sliding_window`` W: only the last W
    tokens are read (table entries before the window's first block never
    are); ``logits_soft_cap`` c: scores become c * tanh(score / c).
    """
    if not triton_paged_decode_available():
        raise RuntimeError("Triton is not installed; use the PyTorch decode path")
    # Imported here, not at the top: this is where Triton first loads.
    from pagedllm.kernels.triton_paged_jit import paged_decode_kernel

    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    quantized = _check_pool(key_cache, value_cache, key_scale, value_scale)
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    paged_decode_kernel[(num_seqs, num_heads)](
        out, query, key_cache, value_cache,
        key_scale if quantized else key_cache, value_scale if quantized else value_cache,
        block_tables, context_lens,
        scale, sliding_window or 0, logits_soft_cap or 0.0,
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
        WINDOWED=sliding_window is not None,
        CAPPED=logits_soft_cap is not None,
    )
    return out

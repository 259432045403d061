"""The Triton JIT kernel behind ``pagedllm.kernels.triton_moe``.

A module of its own, imported on the first call, so that a CPU run never loads Triton (as
``triton_paged_jit``). Under ``TRITON_INTERPRET=1``, set before this module is imported, the
kernel runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_matmul_kernel(
    a_ptr, b_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    N, K, num_pairs,
    stride_a_row, stride_b_expert, stride_b_row, stride_c_row,
    ROWS_PER_A: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair] = A[pair // ROWS_PER_A] @ B[expert].T for the BLOCK_M pairs of block
    ``program_id(0)`` (all routed to one expert) and BLOCK_N output columns.

    ``sorted_pairs`` lists pair ids grouped by expert, each expert's run padded to a multiple
    of BLOCK_M with ``num_pairs`` (a row that is neither loaded nor stored); ``block_experts``
    names each block's expert. A pair is (token, k): A is the tokens [T, K] with
    ROWS_PER_A = top_k, or a per-pair tensor [pairs, K] with ROWS_PER_A = 1. B is the stacked
    weights [E, N, K], rows contiguous; C is [pairs, N] in its own dtype. UPCAST multiplies
    in fp32 (Triton's interpreter multiplies bf16 tiles as their raw bits; a bf16 product is
    exact in fp32, so only the summation order can differ from the GPU's bf16 dot).
    """
    block = tl.program_id(0)
    # The grid covers the most blocks any routing could need; the rest stop here.
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // ROWS_PER_A).to(tl.int64)[:, None] * stride_a_row + ks[None, :]
    b_ptrs = b_ptr + expert * stride_b_expert + cols[None, :] * stride_b_row + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        # "ieee": fp32 models multiply in fp32, not TF32 (greedy parity with the CPU path).
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_c_row + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])

"""The experts of a mixture of experts in Triton, for the GPU path (vLLM's ``fused_moe`` as the anchor).

A step's (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (``align_pairs``, vLLM's ``moe_align_block_size``); then one kernel
launch multiplies every block of pairs by its expert's gate|up weights, and a second by its
down weights (``triton_moe_jit.grouped_matmul_kernel``): an expert without tokens is never
read, and no per-expert loop runs on the host. Between the two, gpt-oss's expert biases are
added (one gather per projection) and the activation (``act(gate) * up``) runs in PyTorch; after them, each pair's output is scaled by its
routing weight and each token's k terms are summed in increasing expert id, the order (and
the roundings) of the Python loop in ``model/moe/experts.py`` and of Hugging Face's eager
experts.

As with ``triton_paged``, Triton is optional and imported on the first call; under
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors through Triton's interpreter, which is
how the tests check it without a GPU. The block sizes are fixed, not tuned for any GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pagedllm.kernels.triton_paged import triton_paged_decode_available as triton_available

BLOCK_M = 16  # pairs per block: tl.dot's smallest tile side
BLOCK_N = 64
BLOCK_K = 32


def align_pairs(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts, num_padded) for ``indices`` [tokens, top_k].

    ``sorted_pairs`` (int32): pair ids (token * top_k + k), grouped by expert in increasing
    id, each group in pair order and padded to a multiple of BLOCK_M with ``tokens * top_k``
    (no pair); ``block_experts``: the expert of each BLOCK_M block; ``num_padded`` [1]: the
    padded length. Sized for the worst case, never read back to the host: no device sync."""
    flat = indices.reshape(-1)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    # A sorted pair's slot: its expert's padded start plus its rank within the expert.
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    slots = (padded_ends - padded)[experts] + rank
    max_blocks = (num_pairs + min(num_pairs, num_experts) * (BLOCK_M - 1) + BLOCK_M - 1) // BLOCK_M
    sorted_pairs = torch.full((max_blocks * BLOCK_M,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[slots] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=flat.device)
    block_experts = torch.searchsorted(padded_ends // BLOCK_M, blocks, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_ends[-1:]


def _grouped_matmul(a: torch.Tensor, weights: torch.Tensor, routing: tuple[torch.Tensor, ...], num_pairs: int,
                    rows_per_a: int) -> torch.Tensor:
    """[pairs, N]: row p is ``a[p // rows_per_a] @ weights[expert of p].T`` (``weights`` [E, N, K])."""
    from pagedllm.kernels.triton_moe_jit import grouped_matmul_kernel  # Triton loads here, on the first call

    sorted_pairs, block_experts, num_padded = routing
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), (n + BLOCK_N - 1) // BLOCK_N)
    grouped_matmul_kernel[grid](a, weights, out, sorted_pairs, block_experts, num_padded, n, k, num_pairs,
                                a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
                                ROWS_PER_A=rows_per_a, UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
                                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def _plus_bias(out: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor) -> torch.Tensor:
    """Each pair's row (rounded to the model's dtype by the kernel) plus its expert's bias row:
    gpt-oss's ``x @ W + b``, the matmul rounding first, as the CPU paths add it."""
    return out if bias is None else out + bias.index_select(0, experts)


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, indices: torch.Tensor,
                  weights: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                  biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) for x [tokens, H]: ``Experts.forward``
    with the stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] in two launches;
    ``biases``: gpt-oss's per-expert ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H]
    (or None), each added after its projection."""
    if not triton_available():
        raise RuntimeError("Triton is not installed; use the Python expert loop")
    tokens, top_k = indices.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x, gate_up_proj, down_proj = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    routing = align_pairs(indices, gate_up_proj.shape[0])
    num_pairs = tokens * top_k
    experts = indices.reshape(-1)  # pair p's expert
    gate_up = _plus_bias(_grouped_matmul(x, gate_up_proj, routing, num_pairs, top_k), biases[0], experts)
    hidden = act_and_mul(gate_up).contiguous()
    down = _plus_bias(_grouped_matmul(hidden, down_proj, routing, num_pairs, 1), biases[1], experts)
    terms = (down * weights.reshape(-1, 1)).to(x.dtype)
    # Each token's terms in increasing expert id, added into zeros one at a time (the loop's order).
    terms = terms.view(tokens, top_k, -1).take_along_dim(indices.argsort(dim=1)[:, :, None], dim=1)
    out = torch.zeros_like(x)
    for k in range(top_k):
        out += terms[:, k]
    return out

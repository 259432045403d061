"""The grouped expert forward, shared by dense stacks (``experts.Experts``) and packed GGUF
stacks (``packed_experts.PackedExperts``).

A step's (token, expert) pairs are sorted by expert (one stable ``argsort``: within an expert
its tokens keep their order) and their inputs gathered, so expert e's rows are
``offsets[e] .. offsets[e + 1]``. Then one C++ call per projection (``moe_grouped_linear``,
kernels/csrc/moe_grouped.cpp) multiplies every expert that has rows by only those rows, in
parallel over experts x output tiles; activations and routing weights are applied to the
sorted rows in between. Finally each token's k weighted outputs are summed into a zeroed row
in increasing expert id, the order Hugging Face's eager experts add them in (its loop over
experts ``index_add_``s each one), rounding to the model dtype after every add as its bf16
``index_add_`` does. gpt-oss's expert biases are added to each projection's rounded output,
one gathered bias row per sorted (token, expert) row, as Hugging Face's ``x @ W + b`` adds them.

Numerics: each projection multiplies in fp32 (bf16 inputs widened, outputs rounded to the
model dtype once, as oneDNN's bf16 matmul does), summing in another order than MKL: outputs
agree with the per-expert loop (``loop_forward``, the fallback where the kernels did not
build) to fp32 rounding of the sums; the combine is the loop's to the bit.

``PAGEDLLM_MOE_GROUPED=0`` turns the grouped kernel off and every MoE layer takes the
per-expert loop (each expert's projections through the dense or packed single-matrix kernels):
the baseline `pagedllm bench moe` measures the grouped kernel against.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedllm.kernels.cpu import cpu_kernels_for

# GGML type ids the kernel reads dense stacks as (gguf.GGMLQuantizationType.F32 / BF16).
_DENSE_TYPE_IDS = {torch.float32: 0, torch.bfloat16: 30}
_BLOCK = 32  # the kernel reads every row as 32-weight blocks


class ExpertStack(NamedTuple):
    """One stacked projection segment: ``weights`` [experts, out, in or packed bytes] of GGML type
    ``qtype`` (0 fp32, 30 bf16, else packed GGUF blocks); segments of one projection are
    concatenated along the outputs (a GGUF's gate and up of different types)."""

    weights: torch.Tensor
    qtype: int
    out_features: int
    in_features: int


def dense_stack(weights: torch.Tensor) -> ExpertStack | None:
    """A dense [E, out, in] parameter as a kernel segment; None where the kernel cannot read it
    (a dtype other than fp32/bf16, rows not whole 32-weight blocks)."""
    qtype = _DENSE_TYPE_IDS.get(weights.dtype)
    if qtype is None or weights.shape[2] % _BLOCK or not weights.is_contiguous():
        return None
    return ExpertStack(weights, qtype, weights.shape[1], weights.shape[2])


class SortedPairs(NamedTuple):
    """A step's (token, expert) pairs sorted by expert."""

    order: torch.Tensor  # [pairs]: flat index t * top_k + j of each sorted pair
    offsets: torch.Tensor  # int64 [experts + 1]: expert e's pairs are offsets[e] .. offsets[e + 1]
    counts: list[int]  # pairs per expert


def sort_pairs(indices: torch.Tensor, num_experts: int) -> SortedPairs:
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return SortedPairs(order, offsets, counts.tolist())


def _project(kernels, rows: torch.Tensor, segments: list[ExpertStack], offsets: torch.Tensor) -> torch.Tensor:
    """fp32 [pairs, sum of segments' outputs]: each sorted row times its expert's segments."""
    out = torch.empty(rows.shape[0], sum(s.out_features for s in segments), dtype=torch.float32)
    start = 0
    for segment in segments:
        stop = start + segment.out_features
        kernels.moe_grouped_linear(rows, segment.weights, segment.qtype, offsets, out[:, start:stop])
        start = stop
    return out


def grouped_kernels(x: torch.Tensor, *projections: list[ExpertStack | None]):
    """The C++ module when it built and can run these projections on ``x``, else None (also
    under ``PAGEDLLM_MOE_GROUPED=0``)."""
    if os.environ.get("PAGEDLLM_MOE_GROUPED", "1") == "0":
        return None
    if x.dtype not in _DENSE_TYPE_IDS or x.dim() != 2:
        return None
    if any(segment is None for segments in projections for segment in segments):
        return None
    return cpu_kernels_for(x)


def grouped_forward(kernels, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                    gate_up: list[ExpertStack], down: list[ExpertStack],
                    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) for x [tokens, H], through the kernel.
    ``biases``: gpt-oss's per-expert gate|up [E, 2I] and down [E, H] biases (or None)."""
    tokens, top_k = indices.shape
    pairs = sort_pairs(indices, gate_up[0].weights.shape[0])
    # each sorted row's expert, gathered only for the bias rows of a model that has them
    experts = None if biases == (None, None) else indices.reshape(-1)[pairs.order]
    rows = x.float().index_select(0, pairs.order // top_k)
    gate_up_out = plus_bias_rows(_project(kernels, rows, gate_up, pairs.offsets).to(x.dtype), biases[0], experts)
    hidden = act_and_mul(gate_up_out)
    projected = _project(kernels, hidden.float().contiguous(), down, pairs.offsets).to(x.dtype)
    projected = plus_bias_rows(projected, biases[1], experts)
    scaled = (projected * weights.reshape(-1)[pairs.order, None]).to(x.dtype)
    return _sum_in_expert_order(scaled, pairs.order, tokens, top_k)


def plus_bias_rows(out: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor | int | None) -> torch.Tensor:
    """``out`` (already rounded to the model dtype) plus each row's expert's bias row: Hugging
    Face's gpt-oss adds its biases after the matmul (``x @ W + b``), so the matmul rounds first."""
    if bias is None:
        return out
    return out + (bias[experts] if isinstance(experts, int) else bias.index_select(0, experts))


def _sum_in_expert_order(scaled: torch.Tensor, order: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """out[t] = ((0 + y_a) + y_b) + ... over token t's sorted rows in increasing expert id (its
    rows' sorted positions are increasing: the sort is by expert)."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel())
    ranked = position.view(tokens, top_k).sort(dim=1).values
    out = torch.zeros(tokens, scaled.shape[1], dtype=scaled.dtype)
    for k in range(top_k):
        out += scaled.index_select(0, ranked[:, k])
    return out


def loop_forward(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 expert_forward: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The per-expert loop: each expert with tokens runs its MLP over all of them at once
    (``expert_forward(expert, rows)`` in x's dtype) and ``index_add_``s its weighted rows into
    a zeroed output, experts in increasing id (Hugging Face's order)."""
    out = torch.zeros_like(x)
    top_k = indices.shape[1]
    pairs = sort_pairs(indices, num_experts)
    flat_weights = weights.reshape(-1)
    for expert, count in enumerate(pairs.counts):
        if count == 0:
            continue
        chosen = pairs.order[int(pairs.offsets[expert]):int(pairs.offsets[expert + 1])]
        tokens = chosen // top_k
        hidden = expert_forward(expert, x[tokens]) * flat_weights[chosen, None]
        out.index_add_(0, tokens, hidden.to(out.dtype))
    return out

"""Stacked expert weights and the grouped expert forward.

The weights are Hugging Face 5.x's in-memory layout: ``gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``down_proj`` [E, H, I], with gpt-oss's biases
``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H] where the family has them (its
checkpoint's transposed, interleaved layout is converted at load, ``model.gpt_oss``). One
step's (token, expert) pairs are sorted by expert; each expert that has tokens multiplies
all of them at once (one gate|up and one down matmul per expert per layer, never one per
token), and its weighted outputs are added back into their tokens' rows. The experts are
visited in increasing id and each adds into a zeroed output, as Hugging Face's eager
experts do, so every token's terms are summed in Hugging Face's order. With the C++ kernels
built, experts run as one grouped call per projection (``moe.grouped``; gpt-oss's biases are
added to its outputs); the per-expert loop is the fallback. On a GPU with Triton, bias-free
experts run as two grouped kernel launches (``kernels.triton_moe``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.kernels.triton_moe import fused_experts, triton_available
from pagedllm.model.layers import GATED_ACTIVATIONS, linear
from pagedllm.model.moe.grouped import dense_stack, grouped_forward, grouped_kernels, loop_forward, plus_bias_rows


def clamped_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt-oss's activation over ``[gate | up]``: gate clamped above at ``limit``, up to
    [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)`` (Hugging Face's
    ``GptOssExperts._apply_gate``, op for op)."""

    def act_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act_and_mul


class Experts(nn.Module):
    """``num_experts`` gated MLPs of width ``intermediate_size``, stacked. ``act_and_mul``
    replaces the named ``activation`` (gpt-oss's ``clamped_swiglu``); ``bias``: the
    projections have per-expert biases (gpt-oss)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 act_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None, bias: bool = False) -> None:
        super().__init__()
        if act_and_mul is None and activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported expert activation {activation!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
        self.num_experts = num_experts
        self.act_and_mul = act_and_mul or GATED_ACTIVATIONS[activation]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) for every token t of x [tokens, H]."""
        biases = (self.gate_up_proj_bias, self.down_proj_bias)  # gpt-oss's, added after each projection
        if x.is_cuda and triton_available():
            return fused_experts(x, self.gate_up_proj, self.down_proj, indices, weights, self.act_and_mul, biases)
        gate_up, down = [dense_stack(self.gate_up_proj)], [dense_stack(self.down_proj)]
        kernels = grouped_kernels(x, gate_up, down) if self.gate_up_proj.dtype == x.dtype else None
        if kernels is not None:
            return grouped_forward(kernels, x, indices, weights, gate_up, down, self.act_and_mul, biases)
        return loop_forward(x, indices, weights, self.num_experts, self.expert_forward)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s MLP over its tokens' rows ``x`` (the per-expert loop's step)."""
        hidden = self.act_and_mul(plus_bias_rows(linear(x, self.gate_up_proj[expert]), self.gate_up_proj_bias, expert))
        return plus_bias_rows(linear(hidden, self.down_proj[expert]), self.down_proj_bias, expert)

"""Stacked expert weights and the grouped expert forward.

The weights are Hugging Face 5.x's in-memory layout: ``gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``down_proj`` [E, H, I]. One step's
(token, expert) pairs are sorted by expert; each expert that has tokens multiplies all of
them at once (one gate|up and one down matmul per expert per layer, never one per token),
and its weighted outputs are added back into their tokens' rows. The experts are visited
in increasing id and each adds into a zeroed output, as Hugging Face's eager experts do, so
every token's terms are summed in Hugging Face's order. With the C++ kernels built this runs
as one grouped call per projection (``moe.grouped``); the per-expert loop is the fallback.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers import GATED_ACTIVATIONS, linear
from pagedllm.model.moe.grouped import dense_stack, grouped_forward, grouped_kernels, loop_forward


class Experts(nn.Module):
    """``num_experts`` gated MLPs of width ``intermediate_size``, stacked."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported expert activation {activation!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
        self.num_experts = num_experts
        self.act_and_mul = GATED_ACTIVATIONS[activation]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) for every token t of x [tokens, H]."""
        gate_up, down = [dense_stack(self.gate_up_proj)], [dense_stack(self.down_proj)]
        kernels = grouped_kernels(x, gate_up, down) if self.gate_up_proj.dtype == x.dtype else None
        if kernels is not None:
            return grouped_forward(kernels, x, indices, weights, gate_up, down, self.act_and_mul)
        return loop_forward(x, indices, weights, self.num_experts, self.expert_forward)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s MLP over its tokens' rows ``x`` (the per-expert loop's step)."""
        return linear(self.act_and_mul(linear(x, self.gate_up_proj[expert])), self.down_proj[expert])

"""Stacked expert weights and the grouped expert forward.

The weights are Hugging Face 5.x's in-memory layout: ``gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``down_proj`` [E, H, I]. One step's
(token, expert) pairs are sorted by expert; each expert that has tokens multiplies all of
them at once (one gate|up and one down matmul per expert per layer, never one per token),
and its weighted outputs are added back into their tokens' rows. The experts are visited
in increasing id and each adds into a zeroed output, as Hugging Face's eager experts do, so
every token's terms are summed in Hugging Face's order. On a GPU with Triton the same sum
runs as two grouped kernel launches (``kernels.triton_moe``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.triton_moe import fused_experts, triton_available
from pagedllm.model.layers import GATED_ACTIVATIONS, linear


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
        if x.is_cuda and triton_available():
            return fused_experts(x, self.gate_up_proj, self.down_proj, indices, weights, self.act_and_mul)
        out = torch.zeros_like(x)
        top_k = indices.shape[1]
        flat = indices.reshape(-1)
        # Stable: within an expert, its tokens keep their order (each token at most once per expert).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // top_k
            hidden = self.act_and_mul(linear(x[tokens], self.gate_up_proj[expert]))
            hidden = linear(hidden, self.down_proj[expert]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, hidden.to(out.dtype))
        return out

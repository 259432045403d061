"""Tensor parallelism for mixtures of experts: the experts' width is split, not the experts.

Every rank holds every expert, and of each expert a slice of its intermediate dimension
(Megatron's split of one gated MLP, applied to each expert): rank r keeps the gate rows and
the up rows of its slice (so its ``gate_up_proj`` [E, 2I/n, H] is still an expert's gate
rows, then its up rows) and the same columns of ``down_proj`` [E, H, I/n]. The router is
replicated, so every rank picks the same experts with the same weights; each rank's block
output is a partial sum over its slice, and the block all-reduces once (``block``).
Qwen2-MoE's shared expert is split the same way and its sigmoid gate replicated: the gate
scales every rank's partial output by the same factor, so the one all-reduce covers it too.
gpt-oss's gate|up biases are split with the width; its down biases ride on rank 0's partial
sum (each rank's is weighted by the same routing weight, so the sum holds one copy).
The width must divide evenly: every expert's slice has the same width on a rank (one stacked
tensor), and the ranks' shapes stay equal.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedllm.distributed.group import TensorParallelGroup


def _share(width: int, what: str, tp: TensorParallelGroup) -> int:
    """This rank's share of ``width``; ValueError unless the ranks split it evenly."""
    if width % tp.world_size:
        raise ValueError(f"tensor_parallel_size={tp.world_size} does not divide the model's {what} ({width}): "
                         "each rank holds an equal slice of every expert; choose a size that divides it")
    return width // tp.world_size


def expert_widths(config: PretrainedConfig, expert_width: int, tp: TensorParallelGroup) -> tuple[int, int | None]:
    """(this rank's expert width, its shared-expert width or None): ValueError for a width
    ``tp.world_size`` does not divide."""
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return (_share(expert_width, "expert width (moe_intermediate_size)", tp),
            _share(shared, "shared_expert_intermediate_size", tp) if shared else None)


def _gate_up_slice(tensor: torch.Tensor, dim: int, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's gate rows, then its up rows, of a [.., 2I, ..] gate|up tensor along ``dim``."""
    width = tensor.shape[dim] // 2
    count = width // tp.world_size
    start = tp.rank * count
    return torch.cat([tensor.narrow(dim, start, count), tensor.narrow(dim, width + start, count)], dim=dim)


def _down_slice(tensor: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's columns of a [.., H, I] down projection, contiguous."""
    count = tensor.shape[-1] // tp.world_size
    return tensor.narrow(-1, tp.rank * count, count).contiguous()


def _on_rank_zero(tensor: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """A bias added after the down projection: rank 0's partial sum carries it, the others' zeros,
    so the all-reduce adds it once (as the dense row-parallel biases, ``model.sharding``)."""
    return tensor if tp.rank == 0 else torch.zeros_like(tensor)


# Stacked (or fused) name suffix -> how a rank slices it.
_SLICES = {
    ".mlp.experts.gate_up_proj": lambda t, tp: _gate_up_slice(t, 1, tp),
    ".mlp.experts.down_proj": _down_slice,
    # gpt-oss's expert biases: gate|up [E, 2I] split with the width, down [E, H] on rank 0
    ".mlp.experts.gate_up_proj_bias": lambda t, tp: _gate_up_slice(t, 1, tp),
    ".mlp.experts.down_proj_bias": _on_rank_zero,
    ".mlp.shared_expert.gate_up_proj.weight": lambda t, tp: _gate_up_slice(t, 0, tp),
    ".mlp.shared_expert.down_proj.weight": _down_slice,
}


def shard_expert_weights(state_dict: dict[str, torch.Tensor], tp: TensorParallelGroup) -> None:
    """Replace the stacked experts and the fused shared expert (``names.stack_expert_weights``'s
    output) by rank ``tp.rank``'s slices, in place; the router and the shared expert's gate
    stay whole. A no-op with one rank."""
    if tp.world_size == 1:
        return
    for name in list(state_dict):
        for suffix, slice_of in _SLICES.items():
            if name.endswith(suffix):
                state_dict[name] = slice_of(state_dict[name], tp)

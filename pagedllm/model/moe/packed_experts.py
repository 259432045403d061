"""GGUF expert stacks kept in their packed llama.cpp blocks.

llama.cpp merges a layer's experts into one tensor per projection (``ffn_gate_exps``,
``ffn_up_exps``: [E, I, H] in torch order; ``ffn_down_exps``: [E, H, I]; some files fuse
gate and up as ``ffn_gate_up_exps`` [E, 2I, H]). A quantized one loads as a
``PackedExpertWeight``: uint8 [E, rows, bytes per row] of blocks, rows independent as in
``quantized.packed``. ``install_packed_experts`` swaps a layer's ``mlp.experts`` for a
``PackedExperts`` holding them, which runs the grouped kernel on the blocks (``moe.grouped``):
nothing is decoded beyond the 4-row tiles a step's experts multiply. Without the C++ kernels
it loops over the experts with tokens, each one's projection a ``QuantizedLinear``'s packed
matmul (which then decodes tile by tile with ``gguf.quants``).

Safety rules: a layer whose projections are not all packed (an F32 down with a Q8_0 gate/up)
is dequantized to dense tensors and stacked as a Hugging Face checkpoint's; with tensor
parallelism everything is dense (shards are cut from dense weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.model.gguf_reader import GGUFTensor
from pagedllm.model.layers import replace_submodule
from pagedllm.model.moe.grouped import ExpertStack, grouped_forward, grouped_kernels, loop_forward, plus_bias_rows
from pagedllm.model.quantized.modules import packed_matmul
from pagedllm.model.quantized.packed import PACKED_TYPES, dequantize_rows, row_bytes

# The names the GGUF loader gives merged expert tensors (under a layer's ``mlp.experts.``).
_GATE, _UP, _DOWN, _GATE_UP = "gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_up_proj.weight"


@dataclass(frozen=True)
class PackedExpertWeight:
    """One merged expert tensor as the file stores it."""

    blocks: torch.Tensor  # uint8 [experts, out_features, bytes_per_row], contiguous
    qtype: GGMLQuantizationType
    shape: tuple[int, int, int]  # (experts, out_features, in_features)
    dtype: torch.dtype  # the model dtype the dense stack would have

    def __post_init__(self) -> None:
        if self.qtype not in PACKED_TYPES:
            raise ValueError(f"{self.qtype.name} expert tensors are not a packed type")
        expected = (self.shape[0], self.shape[1], row_bytes(self.qtype, self.shape[2]))
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(f"packed {self.qtype.name} experts must be uint8 {expected}, "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @classmethod
    def from_gguf(cls, tensor: GGUFTensor, dtype: torch.dtype) -> PackedExpertWeight:
        experts, rows, in_features = (int(size) for size in reversed(tensor.shape))
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(experts, rows, -1)
        return cls(blocks, GGMLQuantizationType(tensor.tensor_type), (experts, rows, in_features), dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense [E, out, in] stack in ``dtype``, one expert at a time."""
        return torch.stack([dequantize_rows(expert, self.qtype, self.shape[2]).to(self.dtype)
                            for expert in self.blocks])


class PackedExperts(nn.Module):
    """``experts.Experts``' contract over packed stacks: gate|up as one or two segments (two
    when the file's gate and up differ in type), down as one. ``bias``: gpt-oss's dense biases,
    gate|up [E, 2I] and down [E, H] (loaded from the state dict like any parameter), added to
    each projection's output."""

    def __init__(self, gate_up: list[PackedExpertWeight], down: PackedExpertWeight, act_and_mul,
                 bias: bool = False) -> None:
        super().__init__()
        gate_up = _merge(gate_up)
        self.num_experts = down.shape[0]
        self.act_and_mul = act_and_mul
        widths = (sum(w.shape[1] for w in gate_up), down.shape[1])
        # On the meta device: loading assigns the checkpoint's tensors.
        self.gate_up_proj_bias, self.down_proj_bias = (
            nn.Parameter(torch.empty(self.num_experts, width, device="meta")) if bias else None for width in widths)
        self.num_gate_up = len(gate_up)
        # (type id, out, in) of each segment; its blocks are the buffer blocks_<index>.
        self.segment_types = [(int(w.qtype), w.shape[1], w.shape[2]) for w in [*gate_up, down]]
        for index, weight in enumerate([*gate_up, down]):
            self.register_buffer(f"blocks_{index}", weight.blocks, persistent=False)
        # The dense parameters these blocks stand for (the start-up line's count).
        self.num_weights = sum(w.shape[0] * w.shape[1] * w.shape[2] for w in [*gate_up, down])

    def stacks(self) -> tuple[list[ExpertStack], list[ExpertStack]]:
        """(gate|up segments, down segments) over the current buffers."""
        stacks = [ExpertStack(getattr(self, f"blocks_{index}"), *types) for index, types in enumerate(self.segment_types)]
        return stacks[:self.num_gate_up], stacks[self.num_gate_up:]

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.stacks()
        kernels = grouped_kernels(x, gate_up, down)
        if kernels is not None:
            return grouped_forward(kernels, x, indices, weights, gate_up, down, self.act_and_mul,
                                   (self.gate_up_proj_bias, self.down_proj_bias))
        return loop_forward(x, indices, weights, self.num_experts, self.expert_forward)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s MLP over its tokens' rows ``x`` (the per-expert loop's step)."""
        hidden = self.act_and_mul(plus_bias_rows(self.project(expert, 0, x), self.gate_up_proj_bias, expert))
        return plus_bias_rows(self.project(expert, 1, hidden), self.down_proj_bias, expert)

    def project(self, expert: int, which: int, rows: torch.Tensor) -> torch.Tensor:
        """rows @ W^T for one expert's segments: the packed matmul of a ``QuantizedLinear``
        (the C++ kernel per expert, or its decode-and-multiply fallback), rounded to rows' dtype."""
        segments = self.stacks()[which]
        x32 = rows.float().contiguous()
        out = torch.empty(rows.shape[0], sum(s.out_features for s in segments), dtype=torch.float32)
        start = 0
        for segment in segments:
            qtype = GGMLQuantizationType(segment.qtype)
            packed_matmul(x32, segment.weights[expert], qtype, out[:, start:start + segment.out_features])
            start += segment.out_features
        return out.to(rows.dtype)

    def extra_repr(self) -> str:
        types = ", ".join(GGMLQuantizationType(qtype).name for qtype, _, _ in self.segment_types)
        return f"num_experts={self.num_experts}, types=[{types}]"


def install_packed_experts(model: nn.Module, state_dict: dict) -> None:
    """Replace each layer's ``mlp.experts`` whose merged GGUF tensors are all packed with a
    ``PackedExperts``; stack the others densely as ``experts.Experts`` loads them. In place."""
    tp = getattr(model, "tp", None)
    sharded = tp is not None and tp.world_size > 1
    prefixes = {name.removesuffix(_DOWN) for name in state_dict if name.endswith(".mlp.experts." + _DOWN)}
    for prefix in sorted(prefixes):
        parts = [prefix + _GATE_UP] if prefix + _GATE_UP in state_dict else [prefix + _GATE, prefix + _UP]
        gate_up = [state_dict.pop(name) for name in parts]
        down = state_dict.pop(prefix + _DOWN)
        packed = all(isinstance(w, PackedExpertWeight) for w in [*gate_up, down])
        if packed and not sharded:
            module_name = prefix.removesuffix(".")
            old = model.get_submodule(module_name)
            biased = getattr(old, "gate_up_proj_bias", None) is not None
            replace_submodule(model, module_name, PackedExperts(gate_up, down, old.act_and_mul, biased))
            continue
        dense = [w.dequantize() if isinstance(w, PackedExpertWeight) else w for w in [*gate_up, down]]
        state_dict[prefix + "gate_up_proj"] = torch.cat(dense[:-1], dim=1)
        state_dict[prefix + "down_proj"] = dense[-1]


def _merge(gate_up: list[PackedExpertWeight]) -> list[PackedExpertWeight]:
    """gate and up as one segment when they share a type (one kernel call), else two."""
    if len(gate_up) == 1 or gate_up[0].qtype != gate_up[1].qtype:
        return gate_up
    gate, up = gate_up
    blocks = torch.cat([gate.blocks, up.blocks], dim=1)
    return [PackedExpertWeight(blocks, gate.qtype, (gate.shape[0], gate.shape[1] + up.shape[1], gate.shape[2]),
                               gate.dtype)]

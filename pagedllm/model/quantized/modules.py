"""Modules over packed GGUF weights: a linear layer and an embedding.

`QuantizedLinear` has `pagedllm.model.layers.Linear`'s contract ([tokens, in]
-> [tokens, out] in the input's dtype, optional `bias` parameter) but holds its
weight as packed blocks. A fused projection (q/k/v, gate/up) whose parts have
different GGUF types holds one segment per run of equal types; each segment
writes its slice of one output tensor.

Numerics: activations are multiplied in fp32 against the exact fp32 decoded
weights (bf16 inputs are converted in and the output rounded back), so an fp32
model agrees with the same model dequantized at load to fp32 rounding; a bf16
model is closer to the fp32 one than a bf16-dequantized copy is.

The packed blocks are non-persistent buffers: they are not in `state_dict()`,
`load_state_dict` neither expects nor overwrites them, and `.to(dtype)` leaves
uint8 alone while `.to(device)` moves them.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.model.packed_linear import packed_tiles_supported
from pagedllm.model.quantized.packed import TILE_ROWS, PackedWeight, dequantize_rows

# Up to this many rows the C++ kernel decodes 4 weight rows at a time and reuses them
# for every row of x (decode steps); beyond it, it decodes tiles for MKL or, where the
# engine packs fp32 weights (``packed_linear``), for the packed fp32 kernel (prefill).
SMALL_BATCH_ROWS = 48


def packed_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: GGMLQuantizationType, out: torch.Tensor,
                  packed_tiles: bool = False) -> None:
    """out = x @ W^T for fp32 x [rows, in] and packed W, written into the fp32 view `out` [rows, W rows].
    ``packed_tiles``: prefill tiles go through the packed fp32 kernel (only where
    ``packed_tiles_supported`` says so; MKL otherwise)."""
    kernels = cpu_kernels_for(x)
    if kernels is not None:
        kernels.quant_linear(x, blocks, int(qtype), out, SMALL_BATCH_ROWS, packed_tiles)
        return
    for start in range(0, blocks.shape[0], TILE_ROWS):
        stop = min(start + TILE_ROWS, blocks.shape[0])
        weights = dequantize_rows(blocks[start:stop], qtype, x.shape[1])
        out[:, start:stop] = x @ weights.t()


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W the concatenation of packed segments (along the output rows)."""

    def __init__(self, segments: list[PackedWeight], bias: bool, bias_device: torch.device | None = None) -> None:
        super().__init__()
        if not segments or len({segment.shape[1] for segment in segments}) != 1:
            raise ValueError("a quantized linear needs segments that share in_features")
        self.in_features = segments[0].shape[1]
        self.out_features = sum(segment.shape[0] for segment in segments)
        self.qtypes = [segment.qtype for segment in segments]
        self.bounds = []  # (first, last + 1) output row of each segment
        start = 0
        for index, segment in enumerate(segments):
            self.register_buffer(f"blocks_{index}", segment.blocks, persistent=False)
            self.bounds.append((start, start + segment.shape[0]))
            start += segment.shape[0]
        # The bias stays dense and is loaded by load_state_dict like nn.Linear's.
        self.bias = nn.Parameter(torch.empty(self.out_features, device=bias_device)) if bias else None
        # Decided once: the CPU and the switch do not change while the model runs.
        self.packed_tiles = packed_tiles_supported()

    @classmethod
    def fused(cls, parts: list[PackedWeight], bias: bool, bias_device: torch.device | None = None) -> QuantizedLinear:
        """One layer over `parts` concatenated in order; adjacent parts of one type share a segment."""
        runs: list[list[PackedWeight]] = []
        for part in parts:
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        segments = [run[0] if len(run) == 1 else _concat(run) for run in runs]
        return cls(segments, bias, bias_device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float().contiguous()  # a no-op for contiguous fp32 input
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for index, ((start, stop), qtype) in enumerate(zip(self.bounds, self.qtypes)):
            packed_matmul(x32, getattr(self, f"blocks_{index}"), qtype, out[:, start:stop], self.packed_tiles)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        types = ", ".join(qtype.name for qtype in self.qtypes)
        return f"in_features={self.in_features}, out_features={self.out_features}, types=[{types}]"


class PackedEmbedding(nn.Module):
    """Token embedding over packed rows: a lookup decodes only the rows it reads."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("blocks", weight.blocks, persistent=False)
        # An empty float buffer whose dtype `.to(dtype)` updates with the model's: the
        # lookup's output dtype (the packed blocks themselves are uint8 and stay so).
        self.register_buffer("dtype_marker", torch.empty(0, dtype=weight.dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        values = dequantize_rows(rows, self.qtype, self.embedding_dim)
        return values.to(self.dtype_marker.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantizedLinear:
        """A tied LM head multiplying by these same blocks (shared, not copied)."""
        weight = PackedWeight(self.blocks, self.qtype, (self.num_embeddings, self.embedding_dim),
                              self.dtype_marker.dtype)
        return QuantizedLinear([weight], bias=False)


def _concat(parts: list[PackedWeight]) -> PackedWeight:
    blocks = torch.cat([part.blocks for part in parts])
    return PackedWeight(blocks, parts[0].qtype, (blocks.shape[0], parts[0].shape[1]), parts[0].dtype)

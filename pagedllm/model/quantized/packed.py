"""GGUF weights kept in their packed block form, and the one place they are decoded.

A `PackedWeight` is a 2-D GGUF tensor exactly as the file stores it: a uint8
tensor [out_features, bytes_per_row] of llama.cpp blocks (`gguf.GGML_QUANT_SIZES`
gives each type's weights per block and bytes per block). Rows are independent,
so rows can be permuted, sliced and concatenated without decoding anything.

Safety rules:
- Only the types in `PACKED_TYPES` are packed; each has a C++ decoder
  (csrc/quant_linear.cpp) that reproduces `gguf.quants.dequantize`.
- `dequantize_rows` decodes with the C++ kernels on CPU when they built, else
  with `gguf.quants.dequantize` itself (on a CPU copy for other devices): slow
  but the reference, so the fallback is exact by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.model.gguf_reader import GGUFTensor

# The types that stay packed and run through the quantized matmul.
PACKED_TYPES = frozenset(
    {
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.MXFP4,  # gpt-oss's experts
    }
)

# Block types `gguf.quants.dequantize` decodes that have no kernel here: dequantized at load.
DEQUANTIZED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                 "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")
)


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes one packed row of `in_features` weights takes; ValueError when the row is not whole blocks."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if in_features % block_size:
        raise ValueError(f"{qtype.name} rows hold multiples of {block_size} weights, got {in_features}")
    return in_features // block_size * block_bytes


@dataclass(frozen=True)
class PackedWeight:
    """One packed GGUF weight, as the loader puts it in a state dict in place of a dense tensor."""

    blocks: torch.Tensor  # uint8 [out_features, bytes_per_row], contiguous
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (out_features, in_features), the dense weight's Hugging Face shape
    dtype: torch.dtype  # the model dtype the dense weight would have

    def __post_init__(self) -> None:
        if self.qtype not in PACKED_TYPES:
            raise ValueError(f"{self.qtype.name} is not a packed type; packed: {_names(PACKED_TYPES)}")
        expected = (self.shape[0], row_bytes(self.qtype, self.shape[1]))
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(f"packed {self.qtype.name} blocks must be uint8 {expected}, "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @classmethod
    def from_gguf(cls, tensor: GGUFTensor, dtype: torch.dtype) -> PackedWeight:
        """A 2-D GGUF tensor of a packed type, its blocks copied out of the read-only file mapping."""
        rows, in_features = (int(size) for size in reversed(tensor.shape))
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(rows, -1)
        return cls(blocks, GGMLQuantizationType(tensor.tensor_type), (rows, in_features), dtype)

    def rows(self, index: slice | torch.Tensor) -> PackedWeight:
        """The weight restricted (or permuted) to some output rows."""
        blocks = self.blocks[index].contiguous()
        return PackedWeight(blocks, self.qtype, (blocks.shape[0], self.shape[1]), self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense weight in `dtype`, decoded in row tiles so no fp32 copy of the whole exists."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.blocks.device)
        for start in range(0, self.shape[0], TILE_ROWS):
            stop = min(start + TILE_ROWS, self.shape[0])
            out[start:stop] = dequantize_rows(self.blocks[start:stop], self.qtype, self.shape[1])
        return out


# Rows decoded at once by the fallback paths: about 2-8 MB of fp32 for usual widths.
TILE_ROWS = 512


def dequantize_rows(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """Packed rows as fp32 [rows, in_features] on the rows' device."""
    kernels = cpu_kernels_for(blocks)
    if kernels is not None:
        return kernels.quant_dequantize(blocks.contiguous(), int(qtype), in_features)
    values = gguf.quants.dequantize(blocks.cpu().numpy(), qtype)
    return torch.from_numpy(values).reshape(blocks.shape[0], in_features).to(blocks.device)


def _names(types: frozenset[GGMLQuantizationType]) -> str:
    return ", ".join(sorted(t.name for t in types))

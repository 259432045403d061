"""Random packed GGUF weights for the quantized-weight tests, and their oracle.

Blocks are random bytes (the gguf package cannot quantize the K types) whose
fp16 scale fields (MXFP4: exponent byte) are then set to sane values, so every decoded weight is a
moderate finite number; `gguf.quants.dequantize` of the same bytes is the oracle.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagedllm.model.quantized.packed import PackedWeight

# Byte offsets, inside one block, of each type's fp16 scale (and min) fields.
SCALE_OFFSETS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.MXFP4: (),
}
PACKED = list(SCALE_OFFSETS)
# MXFP4's scale is one E8M0 exponent byte (2^(e - 128)): 118..126 keeps the weights moderate.
_MXFP4_EXPONENTS = (118, 127)


def random_blocks(qtype: T, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes_per_row] of random blocks with scales in [0.002, 0.05]."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * (in_features // block_size), block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.002, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:
        blocks[:, 0] = rng.integers(*_MXFP4_EXPONENTS, size=blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(rows, -1)


def random_packed(qtype: T, rows: int, in_features: int, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> tuple[PackedWeight, torch.Tensor]:
    """A packed weight and its dense fp32 oracle (gguf's dequantization of the same bytes)."""
    blocks = random_blocks(qtype, rows, in_features, seed)
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).reshape(rows, in_features)
    return PackedWeight(torch.from_numpy(blocks), qtype, (rows, in_features), dtype), dense

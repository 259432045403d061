"""One layer's slice of the paged KV pool, and how K/V are stored in it.

``kv_cache_dtype="auto"`` stores K and V in the model's dtype. ``"int8"`` and
``"fp8_e4m3"`` store them quantized, each (token, KV head) vector of
``head_dim`` values with its own fp32 scale, kept in block-major tensors
beside the values: the block is the unit that carries its scales.

The rule for blocks that are appended to: a token's scale is fixed when that
token is written and depends on that token's values alone. Appending a token to
a block never rescales or requantizes the tokens already in it, nothing is ever
clamped (the scale is the vector's own absolute maximum over the type's
largest value), and the same token ids at the same positions always give the
same bytes, so a block found by prefix caching holds exactly what a recompute
would write. The cost is one fp32 per (token, KV head): 4 bytes per
``head_dim`` bytes of int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import KV_CACHE_DTYPES
from pagedllm.kernels.cpu import cpu_kernels_for

__all__ = ["KV_CACHE_DTYPES", "LayerKVCache", "allocate_layer", "dequantize", "quantize"]

# Largest magnitude each stored type represents: a vector's absolute maximum maps to it.
_QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
# fp8 is stored as its raw bytes (uint8): index_copy_ / index_select have no fp8 kernels on CPU.
_STORAGE_DTYPE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
# A vector of zeros still gets a positive scale, so dequantizing never divides by zero.
_MIN_SCALE = 1e-12


@dataclass
class LayerKVCache:
    """K and V of one layer for every block of the pool.

    Every tensor is block-major (``[num_blocks, block_size, ...]``), so copying,
    swapping or sharing a block is the same index along dim 0 of each tensor
    in :meth:`tensors`: a quantized block's scales move with it.
    """

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor
    kv_cache_dtype: str = "auto"
    key_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] fp32 when quantized
    value_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def tensors(self) -> list[torch.Tensor]:
        scales = [self.key_scale, self.value_scale] if self.quantized else []
        return [self.key, self.value, *scales]

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              read_back: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Store token i's K/V ([tokens, kv_heads, head_dim]) at pool slot
        ``slot_mapping[i]`` (block * block_size + offset). Returns K and V as
        the pool now holds them: the inputs themselves, or, with ``read_back``
        on a quantized pool, their dequantized values (otherwise the inputs,
        which the caller then must not read as stored values)."""
        num_kv_heads, head_dim = self.key.shape[2], self.key.shape[3]
        if not self.quantized:
            kernels = cpu_kernels_for(key)
            if kernels is not None and _heads_contiguous(key) and _heads_contiguous(value):
                kernels.write_kv_cache(key, value, self.key, self.value, slot_mapping)
                return key, value
            self.key.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
            self.value.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
            return key, value
        held = []
        for source, stored, scales in ((key, self.key, self.key_scale), (value, self.value, self.value_scale)):
            quantized, scale = quantize(source, self.kv_cache_dtype)
            stored.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, quantized)
            scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)
            held.append(dequantize(quantized, scale, self.kv_cache_dtype, source.dtype) if read_back else source)
        return held[0], held[1]

    def gather(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, max_blocks] block ids -> K and V as
        [batch, num_kv_heads, max_blocks * block_size, head_dim] in ``dtype``
        (dequantized when the pool is quantized)."""
        return self._gather(self.key, self.key_scale, block_tables, dtype), \
            self._gather(self.value, self.value_scale, block_tables, dtype)

    def _gather(self, stored: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        batch, max_blocks = block_tables.shape
        _, block_size, num_kv_heads, head_dim = stored.shape
        flat = block_tables.reshape(-1)
        gathered = stored.index_select(0, flat)
        if self.quantized:
            gathered = dequantize(gathered, scales.index_select(0, flat), self.kv_cache_dtype, dtype)
        return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _heads_contiguous(rows: torch.Tensor) -> bool:
    """Each token's [kv_heads, head_dim] values are one run of memory (rows may be
    strided, as slices of the fused qkv output): what the C++ cache write copies."""
    return rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (stored values, [...] fp32 scales); each vector is
    scaled so its absolute maximum lands on the type's largest value."""
    limit = _QUANT_MAX[kv_cache_dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / limit).clamp_min(_MIN_SCALE)
    scaled = x / scale.unsqueeze(-1)
    if kv_cache_dtype == "int8":
        return scaled.round().clamp(-limit, limit).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Stored values and their [...] scales -> [..., head_dim] values in ``dtype``."""
    values = stored.view(torch.float8_e4m3fn) if kv_cache_dtype == "fp8_e4m3" else stored
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def allocate_layer(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_cache_dtype: str, device: torch.device) -> LayerKVCache:
    """A zeroed layer cache for ``num_blocks`` blocks."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "auto":
        return LayerKVCache(torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape, dtype=dtype, device=device))
    storage = _STORAGE_DTYPE[kv_cache_dtype]
    return LayerKVCache(
        torch.zeros(shape, dtype=storage, device=device),
        torch.zeros(shape, dtype=storage, device=device),
        kv_cache_dtype,
        torch.ones(shape[:3], dtype=torch.float32, device=device),
        torch.ones(shape[:3], dtype=torch.float32, device=device),
    )


def kv_bytes_per_token_per_kv_head(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """K and V of one token for one KV head of one layer, scales included."""
    if kv_cache_dtype == "auto":
        return 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * (head_dim + 4)  # 1-byte values + one fp32 scale, for K and for V

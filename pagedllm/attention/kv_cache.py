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

Before int8 quantization, each K and V vector is rotated by an orthonormal Hadamard
matrix H (``hadamard_rotate``; QuaRot's trick, applied to the KV cache). A
model's keys carry a few outlier channels many times larger than the rest; a
per-vector scale fitted to the outlier leaves the other channels a handful of
int8 steps. H spreads every channel over all of them, so the vector's maximum
is near its root-mean-square and every channel keeps its precision. H is fixed
and applied to each vector alone, so the rule above still holds. Attention is
unchanged by it: q . k = (qH) . (kH), and the weighted sum of the rotated
values is the rotated output, so a decode kernel reads the stored int8 as it
is, given ``qH``, and its output is rotated back (H is its own inverse).
fp8 is not rotated: e4m3 keeps a relative precision per value, so an outlier
costs the other channels nothing, and rotating would spread the outlier's own
error over every channel (measured: 3.5x the error of unrotated e4m3).

Full-precision tails (int8 only, issues 23 and 55). Besides the int8 pool, the
runner keeps each sequence's still-filling last block in full precision:
``tail_key`` / ``tail_value`` of ``[num_tail_slots, block_size, num_kv_heads,
head_dim]`` in the model's dtype, in the rotated basis (so a decode kernel
reads a tail with the same rotated query as the int8 blocks). They are views
over the int8 pool's own bytes: tail slot ``s`` is the key (value) bytes of
blocks ``[s * k, (s + 1) * k)``, ``k = tail_run_blocks(dtype)``, which the
scheduler's requests hold as tails (``core/kv_managers/tail_runs.py``), so a
tail costs pool blocks only while a sequence writes. A pool too small for tails
to pay has none (``tails_pay``; ``LayerKVCache.has_tails`` False): every key is
read from the int8 pool, as without tails anywhere.
Every token still goes to the int8 pool as above (a block that fills needs no
conversion; prefix caching, copy-on-write and swap see only int8 blocks); a
token in a block that will not be full after it is *also* written to its
block's tail slot (``worker.tail_slots`` decides which slot). The reading
rule: a query at position p reads key j <= p at full precision iff j and p
are in the same block and p is not that block's last position
(``p % block_size != block_size - 1``); every other key is read from the
int8 pool. The rule depends on positions alone, so results do not depend on
chunking, batching, or whether a prefix came from the cache: a full block is
only ever read as int8, and the one token of a full block that a full
prefix-cache hit recomputes sits at the block's last position. A tail slot
whose block lost its earlier tokens' tail (a swapped-in block) is filled with
those tokens' int8 values, so they read exactly as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config.cache import KV_CACHE_DTYPES
from pagedllm.kernels.cpu import cpu_kernels_for

__all__ = ["KV_CACHE_DTYPES", "LayerKVCache", "allocate_layer", "dequantize", "hadamard_rotate", "quantize",
           "tail_run_blocks"]

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
    # int8 only: [num_tail_slots, block_size, num_kv_heads, head_dim] in the model's
    # dtype, rotated; indexed by tail slot, not block; views over ``key`` / ``value``
    # (``allocate_layer``), so not in ``tensors()``.
    tail_key: torch.Tensor | None = None
    tail_value: torch.Tensor | None = None
    # The KV cache group whose block tables this layer reads (``core.kv_groups``;
    # ``AttentionMetadata.for_cache``). Layers of different groups may share one
    # slot cache's tensors: they never use the same block at the same time.
    group: int = 0

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def rotated(self) -> bool:
        """Whether K/V are stored Hadamard-rotated (int8; see the module docstring)."""
        return self.kv_cache_dtype == "int8"

    def tensors(self) -> list[torch.Tensor]:
        scales = [self.key_scale, self.value_scale] if self.quantized else []
        return [self.key, self.value, *scales]

    def pretouch(self) -> None:
        """Write every page of the layer's tensors (zeros; the tails are views over
        them), so that their memory is resident now rather than as blocks fill
        (``allocate_layer``)."""
        for tensor in self.tensors():
            tensor.zero_()

    @property
    def has_tails(self) -> bool:
        return self.tail_key is not None

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              read_back: bool = False, tail_rows: torch.Tensor | None = None,
              tail_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store token i's K/V ([tokens, kv_heads, head_dim]) at pool slot
        ``slot_mapping[i]`` (block * block_size + offset), and with tails, token
        ``tail_rows[j]`` also at tail position ``tail_slots[j]`` (tail slot *
        block_size + offset). Returns K and V as the pool now holds them: the
        inputs themselves, or, with ``read_back`` on a quantized pool, their
        dequantized values (otherwise the inputs, which the caller then must not
        read as stored values)."""
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
        writes_tails = self.has_tails and tail_rows is not None and tail_rows.numel() > 0
        for source, stored, scales, tail in ((key, self.key, self.key_scale, self.tail_key),
                                             (value, self.value, self.value_scale, self.tail_value)):
            rotated = self.in_storage_basis(source.float())
            quantized, scale = quantize(rotated, self.kv_cache_dtype)
            stored.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, quantized)
            scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)
            if writes_tails:
                # The tail holds the rotated values in the model's dtype (``as_tail_holds``).
                tail.view(-1, num_kv_heads, head_dim).index_copy_(0, tail_slots, rotated[tail_rows].to(tail.dtype))
            held.append(self._unrotated(quantized, scale, source.dtype) if read_back else source)
        return held[0], held[1]

    def as_tail_holds(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] fresh K or V -> their values as a tail would give them
        back (stored rotated in ``x``'s dtype, read unrotated): what a prefill
        reads at full precision for its own tokens, bit for bit what a later
        chunk reads from the tail."""
        return self.in_storage_basis(self.in_storage_basis(x))

    def gather_tails(self, tail_slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] tail slots -> their K and V as [n, block_size, num_kv_heads, head_dim]
        in the model's basis."""
        return tuple(self.in_storage_basis(t.index_select(0, tail_slots)).to(dtype)
                     for t in (self.tail_key, self.tail_value))

    def fill_tails(self, blocks: torch.Tensor, tail_slots: torch.Tensor) -> None:
        """Tail slot ``tail_slots[i]`` := block ``blocks[i]``'s int8 values (rotated
        basis): a slot given to a block whose earlier tokens have no tail reads
        them exactly as the pool stores them."""
        for stored, scales, tail in ((self.key, self.key_scale, self.tail_key),
                                     (self.value, self.value_scale, self.tail_value)):
            values = dequantize(stored.index_select(0, blocks), scales.index_select(0, blocks), "int8", tail.dtype)
            tail.index_copy_(0, tail_slots, values)

    def copy_tails(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Tail slot ``dst[i]`` := tail slot ``src[i]`` (all sources read first)."""
        for tail in (self.tail_key, self.tail_value):
            tail.index_copy_(0, dst, tail.index_select(0, src))

    def in_storage_basis(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] vectors in the basis the pool stores: a query before a
        decode kernel reads the pool, and that kernel's output back (H is its
        own inverse). ``x`` itself when the pool is not rotated."""
        return hadamard_rotate(x.float()).to(x.dtype) if self.rotated else x

    def _unrotated(self, stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored vectors and their scales -> the values they hold, in the model's basis."""
        return self.in_storage_basis(dequantize(stored, scale, self.kv_cache_dtype, torch.float32)).to(dtype)

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
            gathered = self._unrotated(gathered, scales.index_select(0, flat), dtype)
        return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _heads_contiguous(rows: torch.Tensor) -> bool:
    """Each token's [kv_heads, head_dim] values are one run of memory (rows may be
    strided, as slices of the fused qkv output): what the C++ cache write copies."""
    return rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """[..., d] vectors times the orthonormal Hadamard matrix H (symmetric, its own
    inverse), by the fast Walsh-Hadamard transform: log2(n) rounds of pairwise
    sums and differences. Elementwise, so each vector's result never depends on
    what else is in the batch (a matmul's summation order can). For a ``d`` that
    is not a power of two, H is block-diagonal: an n x n Hadamard per run of n
    channels, n the largest power of two dividing ``d``."""
    d = x.shape[-1]
    n = d & -d
    lead = x.shape[:-1]
    y = x.reshape(*lead, d // n, n)
    half = 1
    while half < n:
        pairs = y.reshape(*lead, d // n, n // (2 * half), 2, half)
        y = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2)
        half *= 2
    return y.reshape(x.shape) * n**-0.5


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


def tail_run_blocks(dtype: torch.dtype) -> int:
    """int8 blocks one full-precision tail of ``dtype`` takes: its values are that
    many bytes each, and an int8 block's key (value) tensor holds one byte per
    value (its scales live in other tensors and go unused)."""
    return torch.empty((), dtype=dtype).element_size()


def _tail_view(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tail slot ``s`` over blocks ``[s * k, (s + 1) * k)`` of an int8 block-major
    tensor, read as ``dtype`` (``k = tail_run_blocks(dtype)``)."""
    run = tail_run_blocks(dtype)
    num_slots = stored.shape[0] // run
    return stored[: num_slots * run].view(-1).view(dtype).view(num_slots, *stored.shape[1:])


def allocate_layer(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_cache_dtype: str, device: torch.device, tails: bool = False) -> LayerKVCache:
    """An uninitialised layer cache for ``num_blocks`` blocks (and, for int8 with
    ``tails``, full-precision tail slots over the same bytes: ``_tail_view``).

    Reserved, not written: on a CPU the operating system backs a page of a large
    allocation only when it is first written, so the pool's resident memory
    grows with the blocks in use (``LayerKVCache.pretouch`` pays it up front).
    Safety rule: a slot holds garbage (NaN, inf) until a token is written to
    it, so no reader may read one it did not write, not even under a mask (a
    masked NaN still poisons a sum: 0 * NaN = NaN); readers that gather padded
    ranges replace what they must not see (``torch_paged``), kernels skip it.
    Copies and swaps move whole blocks, garbage included, which is harmless."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "auto":
        return LayerKVCache(torch.empty(shape, dtype=dtype, device=device),
                            torch.empty(shape, dtype=dtype, device=device))
    if tails and kv_cache_dtype != "int8":
        raise ValueError(f"full-precision tails are for int8 pools, not {kv_cache_dtype}")
    storage = _STORAGE_DTYPE[kv_cache_dtype]
    key, value = torch.empty(shape, dtype=storage, device=device), torch.empty(shape, dtype=storage, device=device)
    return LayerKVCache(
        key,
        value,
        kv_cache_dtype,
        torch.empty(shape[:3], dtype=torch.float32, device=device),
        torch.empty(shape[:3], dtype=torch.float32, device=device),
        _tail_view(key, dtype) if tails else None,
        _tail_view(value, dtype) if tails else None,
    )


def kv_bytes_per_token_per_kv_head(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """K and V of one token for one KV head of one layer, scales included."""
    if kv_cache_dtype == "auto":
        return 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * (head_dim + 4)  # 1-byte values + one fp32 scale, for K and for V


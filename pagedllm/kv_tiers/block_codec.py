"""One pool block as one flat byte string, and back: the unit the tiers store.

A block of the pool is one slab per tensor per layer (block-major: K, V and,
for a quantized pool, their scales). The codec concatenates those slabs, in
layer order and ``LayerKVCache.tensors()`` order, as raw bytes: an int8 block
stays int8 with its fp32 scales (4x less than fp32 K/V), a bf16 block stays
bf16. Moving the bytes unchanged is what makes a tier hit exact: the block
loaded is the block that was evicted, bit for bit.
"""

from __future__ import annotations

import hashlib
import json

import torch

from pagedllm.attention.kv_cache import LayerKVCache


class BlockCodec:
    """The byte layout of one block of a given pool (``layout`` names it)."""

    def __init__(self, kv_caches: list[LayerKVCache]) -> None:
        if not kv_caches:
            raise ValueError("a KV tier needs a pool with at least one layer")
        first = kv_caches[0].tensors()
        self.device = first[0].device
        # (shape of one block, dtype) per tensor, every layer alike.
        self.slabs = [(tuple(t.shape[1:]), str(t.dtype)) for layer in kv_caches for t in layer.tensors()]
        self.slab_bytes = [t[0].numel() * t.element_size() for layer in kv_caches for t in layer.tensors()]
        self.block_bytes = sum(self.slab_bytes)
        # Each slab's byte range within a block.
        ends = [sum(self.slab_bytes[: i + 1]) for i in range(len(self.slab_bytes))]
        self.slab_spans = list(zip([0, *ends[:-1]], ends))

    @property
    def layout(self) -> str:
        """A digest of the layout: part of the tiers' fingerprint."""
        return hashlib.sha256(json.dumps(self.slabs).encode()).hexdigest()

    def gather(self, kv_caches: list[LayerKVCache], block_ids: list[int]) -> list[torch.Tensor]:
        """Each block's bytes, as its own uint8 host tensor (owned: nothing else shares it).

        One copy per block (``torch.cat`` of its slabs): a block's bytes are
        copied once, straight into the tensor the tier keeps."""
        slabs = _slabs(kv_caches)
        return [torch.cat([slab[block_id] for slab in slabs]).cpu() for block_id in block_ids]

    def scatter(self, kv_caches: list[LayerKVCache], payloads: list[torch.Tensor], block_ids: list[int]) -> None:
        """Write each payload into its pool block (every layer, every tensor)."""
        slabs = _slabs(kv_caches)
        for payload, block_id in zip(payloads, block_ids):
            if payload.numel() != self.block_bytes:
                raise ValueError(f"a tier block of {payload.numel()} bytes does not fit this pool's "
                                 f"{self.block_bytes}-byte blocks")
            source = payload.to(self.device, non_blocking=True)
            for slab, part in zip(slabs, torch.split(source, self.slab_bytes)):
                slab[block_id].copy_(part)


    def write_rows(self, kv_caches: list[LayerKVCache], block_ids: list[int], rows: torch.Tensor,
                   row_ids: list[int]) -> None:
        """Copy pool blocks into rows of ``rows`` (``[n, block_bytes]`` uint8 on the
        host), in this codec's layout: one batched copy per tensor of the pool."""
        src = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        dst = torch.tensor(row_ids, dtype=torch.long)
        for slab, (start, end) in zip(_slabs(kv_caches), self.slab_spans):
            rows[:, start:end].index_copy_(0, dst, slab.index_select(0, src).cpu())

    def read_rows(self, kv_caches: list[LayerKVCache], rows: torch.Tensor, row_ids: list[int],
                  block_ids: list[int]) -> None:
        """Copy rows of ``rows`` back into pool blocks: the inverse of ``write_rows``."""
        src = torch.tensor(row_ids, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for slab, (start, end) in zip(_slabs(kv_caches), self.slab_spans):
            slab.index_copy_(0, dst, rows[src, start:end].to(self.device, non_blocking=True))


def _slabs(kv_caches: list[LayerKVCache]) -> list[torch.Tensor]:
    """Every block-major tensor of the pool as bytes, in the codec's order."""
    return [_as_bytes(t) for layer in kv_caches for t in layer.tensors()]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A block-major tensor as ``[num_blocks, bytes per block]`` uint8, sharing its storage."""
    return tensor.view(tensor.shape[0], -1).view(torch.uint8)

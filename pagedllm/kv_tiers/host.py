"""The host-memory tier's bytes: one uint8 tensor per block, keyed by block hash.

Which hashes it holds is decided by ``core/tier_index.py`` on the scheduler's
thread; this store only carries out the moves it is sent, and takes the
blocks a disk fetch brings in. Dict operations are atomic under the GIL, so
the fetch thread's ``put`` needs no lock: the index never names an entry the
fetch has not reported, and never drops one it is still fetching.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.core.block_hash import BlockHash
from pagedllm.kv_tiers.block_codec import BlockCodec


class HostBlockStore:
    def __init__(self, codec: BlockCodec) -> None:
        self.codec = codec
        self.payloads: dict[BlockHash, torch.Tensor] = {}

    @property
    def num_bytes(self) -> int:
        return len(self.payloads) * self.codec.block_bytes

    def offload(self, kv_caches: list[LayerKVCache], pairs: list[tuple[int, BlockHash]]) -> None:
        """Copy pool blocks into new entries: ``pairs`` of (block id, hash)."""
        payloads = self.codec.gather(kv_caches, [block_id for block_id, _ in pairs])
        for (_, block_hash), payload in zip(pairs, payloads):
            self.payloads[block_hash] = payload

    def load(self, kv_caches: list[LayerKVCache], pairs: list[tuple[BlockHash, int]]) -> None:
        """Copy entries into pool blocks: ``pairs`` of (hash, block id)."""
        self.codec.scatter(kv_caches, [self.payloads[h] for h, _ in pairs], [block_id for _, block_id in pairs])

    def drop(self, block_hashes: list[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.payloads.pop(block_hash, None)

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """A fetched block's bytes (the disk tier's reader thread)."""
        self.payloads[block_hash] = payload

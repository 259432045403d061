"""The runner's half of the tiers: the stores a step's tier moves go to.

``core/tier_index.py`` decides; ``worker/block_mover.py`` calls these in the
order ``core.block_moves.Phase`` states. Offloads, loads and drops are the
host store's (the pool's one ``HostKVStore``, swap included); a persist takes
the block's copy now and the disk tier's thread writes the file behind.
"""

from __future__ import annotations

import time

from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.core.block_moves import TierDrop, TierLoad, TierOffload, TierPersist
from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.host import HostKVStore


class RunnerTiers:
    def __init__(self, host: HostKVStore, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk
        self.load_seconds = 0.0  # copying tier blocks into the pool
        self.bytes_loaded = 0

    def offload(self, kv_caches: list[LayerKVCache], moves: list[TierOffload]) -> None:
        self.host.offload(kv_caches, moves)

    def load(self, kv_caches: list[LayerKVCache], moves: list[TierLoad]) -> None:
        started = time.perf_counter()
        self.host.load(kv_caches, moves)
        self.load_seconds += time.perf_counter() - started
        self.bytes_loaded += len(moves) * self.host.codec.block_bytes

    def drop(self, kv_caches: list[LayerKVCache], moves: list[TierDrop]) -> None:
        self.host.drop([move.key for move in moves])

    def persist(self, kv_caches: list[LayerKVCache], moves: list[TierPersist]) -> None:
        if self.disk is None:
            return
        payloads = self.host.codec.gather(kv_caches, [move.block for move in moves])
        for move, payload in zip(moves, payloads):
            self.disk.write_behind(move.key, payload)

    def shutdown(self) -> None:
        if self.disk is not None:
            self.disk.shutdown()

"""The runner's half of the tiers: it carries out each step's ``TierMoves``.

``core/tier_index.py`` decides; this moves bytes, in the order its rules
state: ``before_block_moves`` (offloads: the evicted blocks are about to be
reused), ``after_block_moves`` (loads, then drops), ``after_forward``
(persists: a newly cached block's K/V exist only once the forward wrote them;
the copy is taken now, the file is written behind by the disk tier's thread).
"""

from __future__ import annotations

import time

from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.core.tier_index import TierMoves
from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.host import HostBlockStore


class RunnerTiers:
    def __init__(self, host: HostBlockStore, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk
        self.load_seconds = 0.0  # copying tier blocks into the pool
        self.bytes_loaded = 0

    def before_block_moves(self, kv_caches: list[LayerKVCache], moves: TierMoves) -> None:
        self.host.offload(kv_caches, moves.offload)

    def after_block_moves(self, kv_caches: list[LayerKVCache], moves: TierMoves) -> None:
        if moves.load:
            started = time.perf_counter()
            self.host.load(kv_caches, moves.load)
            self.load_seconds += time.perf_counter() - started
            self.bytes_loaded += len(moves.load) * self.host.codec.block_bytes
        self.host.drop(moves.drop)

    def after_forward(self, kv_caches: list[LayerKVCache], moves: TierMoves) -> None:
        if self.disk is None or not moves.persist:
            return
        payloads = self.host.codec.gather(kv_caches, [block_id for block_id, _ in moves.persist])
        for (_, block_hash), payload in zip(moves.persist, payloads):
            self.disk.write_behind(block_hash, payload)

    def shutdown(self) -> None:
        if self.disk is not None:
            self.disk.shutdown()

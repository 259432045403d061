"""Build the tiers below the pool from the engine's config: the index the
scheduler's KV manager keeps and the stores the runner moves bytes with."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.engine import EngineConfig
from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.core.tier_index import TierIndex
from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.fingerprint import tier_fingerprint
from pagedllm.kv_tiers.host import HostKVStore
from pagedllm.kv_tiers.runner_tiers import RunnerTiers


@dataclass
class KVTiers:
    index: TierIndex
    runner: RunnerTiers
    fingerprint: str
    host_bytes: int  # the host tier's capacity (pinned fetches may briefly exceed it)
    block_bytes: int

    def stats(self) -> dict[str, int | float | bool]:
        """Bytes, files and seconds of the tiers (the block counts are the KV manager's)."""
        runner, disk = self.runner, self.runner.disk
        stats: dict[str, int | float | bool] = {
            "host_tier_capacity_bytes": self.host_bytes,
            "host_tier_bytes": runner.host.tier_bytes,
            "tier_load_seconds": runner.load_seconds,
            "tier_loaded_bytes": runner.bytes_loaded,
        }
        if disk is not None:
            stats.update({
                "disk_tier_enabled": disk.enabled,
                "disk_tier_bytes": disk.num_bytes,
                "disk_tier_read_seconds": disk.read_seconds,
                **{f"disk_tier_{name}": disk.counters[name] for name in
                   ("files_written", "bytes_written", "files_read", "bytes_read", "files_evicted", "writes_dropped")},
                **{f"disk_tier_{reason}_files": disk.reasons[reason] for reason in
                   ("truncated", "corrupt", "foreign", "stale")},
            })
        return stats

    def describe(self) -> str:
        """The tiers for the start-up line."""
        parts = []
        if self.index.host_capacity_blocks:
            parts.append(f"host memory {self.host_bytes / 2**20:.1f} MiB "
                         f"({self.index.host_capacity_blocks} blocks)")
        disk = self.runner.disk
        if disk is not None:
            budget = "unbounded" if disk.budget_bytes is None else f"{disk.budget_bytes / 2**20:.1f} MiB"
            state = "" if disk.enabled else ", turned off"
            parts.append(f"disk {disk.folder} ({budget}{state})")
        return "KV offload tiers: " + "; ".join(parts) + f"; {self.block_bytes} bytes per block"


def build_kv_tiers(config: EngineConfig, host: HostKVStore, model_path: str, block_size: int,
                   events: KVEventLog | None, kv_groups: KVGroupLayout | None = None) -> KVTiers | None:
    """The configured tiers (None when none is configured), keeping their host
    entries in the pool's ``host`` store, whose codec covers the slot caches
    (with a hybrid ``kv_groups``), so a tier entry is one group's block."""
    offload = config.kv_offload
    if not offload.enabled:
        return None
    codec = host.codec
    host_blocks = offload.host_blocks if offload.host_blocks is not None else offload.host_bytes // codec.block_bytes
    fingerprint = tier_fingerprint(model_path, config.dtype, config.cache.kv_cache_dtype, block_size, codec.layout,
                                   config.gguf_weights, kv_groups)
    disk = None
    if offload.disk_dir is not None:
        disk = DiskTier(offload.disk_dir, fingerprint, codec.block_bytes, offload.disk_bytes, host.put)
    index = TierIndex(host_blocks, disk, events, block_size)
    return KVTiers(index, RunnerTiers(host, disk), fingerprint, host_blocks * codec.block_bytes, codec.block_bytes)

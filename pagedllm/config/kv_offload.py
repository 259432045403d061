"""The KV offload tiers' options, in pagedllm's spelling and in vLLM's.

A leaf module, torch-free (``config.engine`` validates with it). pagedllm
spells the tiers as three options: ``kv_offload_host_bytes`` (host memory),
``kv_offload_dir`` and ``kv_offload_disk_bytes`` (disk). vLLM's equivalent is
its offloading connector, which this also accepts::

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}

(``num_cpu_blocks`` in place of ``cpu_bytes_to_use`` counts blocks of the
pool's size.) vLLM has no disk tier in that connector: pagedllm's own options
say where the disk tier goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_CONNECTORS = ("OffloadingConnector",)
_ROLES = ("kv_both",)
_EXTRA_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size", "spec_name")


@dataclass(frozen=True)
class KVOffloadConfig:
    """Resolved tiers: bytes of host memory (0: none), the disk folder (None: none)
    and its byte budget (None: unbounded), or host memory counted in blocks."""

    host_bytes: int = 0
    host_blocks: int | None = None  # vLLM's num_cpu_blocks, when given that way
    disk_dir: str | None = None
    disk_bytes: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.host_blocks or self.disk_dir)

    @classmethod
    def from_options(cls, host_bytes: int | None, disk_dir: str | None, disk_bytes: int | None,
                     kv_transfer_config: dict | None) -> KVOffloadConfig:
        """Check and merge both spellings; ``ValueError`` names the option to change."""
        for name, value in (("kv_offload_host_bytes", host_bytes), ("kv_offload_disk_bytes", disk_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")
        if disk_dir is not None and (not isinstance(disk_dir, str) or not disk_dir):
            raise ValueError(f"kv_offload_dir must be a folder path, got {disk_dir!r}")
        if disk_bytes is not None and disk_dir is None:
            raise ValueError("kv_offload_disk_bytes bounds the disk tier: set kv_offload_dir too")
        if disk_bytes == 0:
            raise ValueError("kv_offload_disk_bytes must be > 0 (leave kv_offload_dir unset for no disk tier)")
        config = cls(host_bytes=host_bytes or 0, disk_dir=disk_dir, disk_bytes=disk_bytes)
        if kv_transfer_config is None:
            return config
        if host_bytes:
            raise ValueError("kv_offload_host_bytes and kv_transfer_config both size the host tier: pass one")
        return _from_vllm(kv_transfer_config, config)


def _from_vllm(transfer: dict[str, Any], config: KVOffloadConfig) -> KVOffloadConfig:
    unknown = sorted(set(transfer) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
    if unknown:
        raise ValueError(f"kv_transfer_config: unsupported keys {unknown}; pagedllm takes kv_connector, "
                         "kv_role and kv_connector_extra_config")
    if transfer.get("kv_connector") not in _CONNECTORS:
        raise ValueError(f"kv_transfer_config: kv_connector {transfer.get('kv_connector')!r} is not supported; "
                         f"pagedllm implements {', '.join(_CONNECTORS)} (host-memory offloading)")
    if transfer.get("kv_role", "kv_both") not in _ROLES:
        raise ValueError(f"kv_transfer_config: kv_role must be 'kv_both', got {transfer.get('kv_role')!r}")
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - set(_EXTRA_KEYS):
        raise ValueError(f"kv_transfer_config: kv_connector_extra_config takes {', '.join(_EXTRA_KEYS)}, "
                         f"got {extra!r}")
    if ("cpu_bytes_to_use" in extra) == ("num_cpu_blocks" in extra):
        raise ValueError("kv_transfer_config: give exactly one of cpu_bytes_to_use and num_cpu_blocks "
                         "in kv_connector_extra_config")
    for key in ("cpu_bytes_to_use", "num_cpu_blocks"):
        value = extra.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"kv_transfer_config: {key} must be an integer >= 1, got {value!r}")
    return KVOffloadConfig(host_bytes=extra.get("cpu_bytes_to_use", 0), host_blocks=extra.get("num_cpu_blocks"),
                           disk_dir=config.disk_dir, disk_bytes=config.disk_bytes)

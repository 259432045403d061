"""How much memory the KV pool may take when sized by a fraction."""

from __future__ import annotations

import torch


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory now (after the weights are loaded): the GPU's free
    memory, or the host's MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory instead")

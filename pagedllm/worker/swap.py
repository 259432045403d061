"""Host swap pool: where preempted requests' blocks wait, byte for byte.

On a GPU it is pinned host memory; on a CPU-only machine it is a separate
preallocated host pool, so the copies and the accounting are the same real
mechanics either way.
"""

from __future__ import annotations

import torch


class HostSwapPool:
    """Per layer, K and V host tensors shaped like the device pool, ``num_blocks`` long."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        pin = device.type == "cuda"
        shape = (num_blocks, *block_shape)
        self.caches = [
            (torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)
        ]

    def swap_out(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``pairs`` of (device block, host block)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device_caches[0][0].device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for (device_k, device_v), (host_k, host_v) in zip(device_caches, self.caches):
            host_k.index_copy_(0, dst, device_k.index_select(0, src).cpu())
            host_v.index_copy_(0, dst, device_v.index_select(0, src).cpu())

    def swap_in(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back: ``pairs`` of (host block, device block)."""
        if not pairs:
            return
        device = device_caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for (device_k, device_v), (host_k, host_v) in zip(device_caches, self.caches):
            device_k.index_copy_(0, dst, host_k.index_select(0, src).to(device, non_blocking=True))
            device_v.index_copy_(0, dst, host_v.index_select(0, src).to(device, non_blocking=True))

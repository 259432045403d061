"""Host swap pool: where preempted requests' blocks wait, byte for byte.

On a GPU it is pinned host memory; on a CPU-only machine it is a separate
preallocated host pool, so the copies and the accounting are the same real
mechanics either way. Every block-major tensor of a layer cache is mirrored
(K, V and, for a quantized pool, their scales), so a block's scales are
swapped with it. An int8 pool's full-precision tail of a swapped block is
kept beside it, by host block, until it is swapped back in.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache


class HostSwapPool:
    """Per layer, host tensors shaped like each of the device cache's tensors, ``num_blocks`` long.
    Left uninitialised: a host block is only read after a swap-out wrote it, and
    untouched pages cost no memory until a preemption needs them."""

    def __init__(self, num_blocks: int, device_caches: list[LayerKVCache]) -> None:
        pin = bool(device_caches) and device_caches[0].key.device.type == "cuda"
        self.caches = [
            [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in layer.tensors()]
            for layer in device_caches
        ]
        # Host block -> per layer (K, V) of the tail that went out with it.
        self.tails: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def pretouch(self) -> None:
        """Write every host block once (zeros), so the swap space is resident before a preemption needs it."""
        for host_tensors in self.caches:
            for tensor in host_tensors:
                tensor.zero_()

    def swap_out(self, device_caches: list[LayerKVCache], pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``pairs`` of (device block, host block)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device_caches[0].key.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for layer, host_tensors in zip(device_caches, self.caches):
            for device_tensor, host_tensor in zip(layer.tensors(), host_tensors):
                host_tensor.index_copy_(0, dst, device_tensor.index_select(0, src).cpu())

    def swap_in(self, device_caches: list[LayerKVCache], pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back: ``pairs`` of (host block, device block)."""
        if not pairs:
            return
        device = device_caches[0].key.device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for layer, host_tensors in zip(device_caches, self.caches):
            for device_tensor, host_tensor in zip(layer.tensors(), host_tensors):
                device_tensor.index_copy_(0, dst, host_tensor.index_select(0, src).to(device, non_blocking=True))

    def swap_out_tails(self, device_caches: list[LayerKVCache], pairs: list[tuple[int, int]]) -> None:
        """Copy tail slots to the host: ``pairs`` of (tail slot, host block)."""
        for slot, host in pairs:
            self.tails[host] = [(layer.tail_key[slot].cpu().clone(), layer.tail_value[slot].cpu().clone())
                                for layer in device_caches]

    def swap_in_tails(self, device_caches: list[LayerKVCache], pairs: list[tuple[int, int]]) -> None:
        """Copy tails back into slots: ``pairs`` of (host block, tail slot)."""
        for host, slot in pairs:
            for layer, (key, value) in zip(device_caches, self.tails.pop(host)):
                layer.tail_key[slot].copy_(key)
                layer.tail_value[slot].copy_(value)

"""The one host-memory KV store of a pool: preempted blocks (swap) and the host tier.

Both keep a block as the same bytes, laid out by one ``BlockCodec`` (every
tensor of every slot cache, raw, in order), so a block looks the same wherever
it waits in host memory. They differ only in how an entry is named and sized:

- **Swap**: rows of one preallocated ``[num_swap_blocks, block_bytes]`` arena,
  row ``i`` being host block ``i`` of ``core/swap_space.py``. Swap space is
  reserved up front (the memory planner counts ``swap_space`` as used, pinned
  on a GPU for fast copies, pretouched with ``kv_cache_pretouch``) and
  ``SwapSpace`` bounds it, so an arena indexed by its ids is the simplest
  honest layout: a swap is one batched copy per pool tensor, as before.
- **Host tier**: one owned tensor per entry, keyed by ``tier_key``. Its
  ``TierIndex`` bounds it by LRU but may briefly exceed the bound (pinned
  fetches; a disk-only set-up has capacity 0 and keeps only those), so its
  entries come and go one by one rather than from a fixed arena.

The byte counts stay apart: ``swap_bytes`` is the arena (``swap_space``),
``tier_bytes`` the tier's entries (``host_tier_bytes``, against
``kv_offload_host_bytes``). An int8 pool's full-precision tail of a swapped
block is kept beside it, by host block, until it is swapped back in.

Which entries exist is decided on the scheduler's thread (``SwapSpace``,
``TierIndex``); this store only carries out the moves it is sent, and takes
the blocks a disk fetch brings in. Dict operations are atomic under the GIL,
so the fetch thread's ``put`` needs no lock: the index never names an entry
the fetch has not reported, and never drops one it is still fetching.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.core.block_hash import BlockHash
from pagedllm.core.block_moves import SwapIn, SwapOut, TailIn, TailOut, TierLoad, TierOffload
from pagedllm.kv_tiers.block_codec import BlockCodec


class HostKVStore:
    """Host memory for one pool's blocks: ``num_swap_blocks`` swap rows, left
    uninitialised (a row is only read after a swap-out wrote it, and untouched
    pages cost no memory until a preemption needs them), and the tier's entries."""

    def __init__(self, codec: BlockCodec, num_swap_blocks: int) -> None:
        self.codec = codec
        pin = codec.device.type == "cuda"
        self.swap_rows = torch.empty((num_swap_blocks, codec.block_bytes), dtype=torch.uint8, pin_memory=pin)
        # Host block -> per slot cache (K, V) of the tail that went out with it.
        self.tails: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.entries: dict[BlockHash, torch.Tensor] = {}

    @property
    def swap_bytes(self) -> int:
        return self.swap_rows.numel()

    @property
    def tier_bytes(self) -> int:
        return len(self.entries) * self.codec.block_bytes

    def pretouch(self) -> None:
        """Write every swap row once (zeros), so the swap space is resident before a preemption needs it."""
        self.swap_rows.zero_()

    def swap_out(self, kv_caches: list[LayerKVCache], moves: list[SwapOut]) -> None:
        self.codec.write_rows(kv_caches, [m.device for m in moves], self.swap_rows, [m.host for m in moves])

    def swap_in(self, kv_caches: list[LayerKVCache], moves: list[SwapIn]) -> None:
        self.codec.read_rows(kv_caches, self.swap_rows, [m.host for m in moves], [m.device for m in moves])

    def swap_out_tails(self, kv_caches: list[LayerKVCache], moves: list[TailOut]) -> None:
        for slot, host in moves:
            self.tails[host] = [(layer.tail_key[slot].cpu().clone(), layer.tail_value[slot].cpu().clone())
                                for layer in kv_caches]

    def swap_in_tails(self, kv_caches: list[LayerKVCache], moves: list[TailIn]) -> None:
        for host, slot in moves:
            for layer, (key, value) in zip(kv_caches, self.tails.pop(host)):
                layer.tail_key[slot].copy_(key)
                layer.tail_value[slot].copy_(value)

    def offload(self, kv_caches: list[LayerKVCache], moves: list[TierOffload]) -> None:
        """Copy pool blocks into new tier entries."""
        payloads = self.codec.gather(kv_caches, [m.block for m in moves])
        for move, payload in zip(moves, payloads):
            self.entries[move.key] = payload

    def load(self, kv_caches: list[LayerKVCache], moves: list[TierLoad]) -> None:
        """Copy tier entries into pool blocks."""
        self.codec.scatter(kv_caches, [self.entries[m.key] for m in moves], [m.block for m in moves])

    def drop(self, keys: list[BlockHash]) -> None:
        for key in keys:
            self.entries.pop(key, None)

    def put(self, key: BlockHash, payload: torch.Tensor) -> None:
        """A fetched block's bytes (the disk tier's reader thread)."""
        self.entries[key] = payload

"""The baseline PagedAttention replaced: one contiguous reservation per request.

Each admitted request reserves ``reservation_tokens`` slots (``max_model_len``
in the engine by default) as one run of consecutive blocks of the same pool,
first fit; with ``reservation_tokens=None`` each request reserves what it may
need, prompt + max_tokens (set through ``reserve_for``), as Orca-style servers
do, so reservations differ in size.
Freed runs leave holes; a request that finds no hole large enough waits, even
when the free slots in total would suffice: external fragmentation, counted.
A reservation is just a block table of consecutive block ids, so the model
runs unchanged on it and outputs are identical to the paged layout.

It implements ``KVCacheManagerProtocol`` like the paged manager; it has no
prefix cache, no sharing (forks are refused), no swap space (swap
preemption falls back to recompute, so ``admit_swapped`` is never reached)
and no LoRA adapters (``enable_lora`` needs the paged layout).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping

from pagedllm.core.request import Request
from pagedllm.core.block_moves import AdapterLoad, BlockMovePlan, SwapIn, SwapOut
from pagedllm.core.kv_interface import (Admission, BlockCopy, FirstChunk, KVCacheStats, PrefixHit,
                                        admit_from_prefix)
from pagedllm.utils import cdiv, check_block_size


class ContiguousKVCacheManager:
    """First-fit contiguous reservations over ``num_blocks`` blocks.

    Safety rules: ``allocate_slots`` is all-or-nothing like the paged
    manager's; a request never grows past its reservation (``ValueError``), so
    the engine must refuse requests longer than ``reservation_tokens``.
    """

    def __init__(self, num_blocks: int, block_size: int, reservation_tokens: int | None) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # None: sized per request by reserve_for().
        self.reservation_blocks = None if reservation_tokens is None else cdiv(reservation_tokens, block_size)
        self._sizes: dict[str, int] = {}
        if self.reservation_blocks is not None and self.reservation_blocks > num_blocks:
            raise ValueError(
                f"a contiguous reservation of {reservation_tokens} tokens needs {self.reservation_blocks} blocks "
                f"but the pool has {num_blocks}; enlarge the pool or lower max_model_len"
            )
        # Holes as sorted, non-adjacent (start block, length) runs.
        self.holes: list[tuple[int, int]] = [(0, num_blocks)]
        self.req_to_blocks: dict[str, range] = {}
        self.peak_blocks_in_use = 0
        # Admissions refused although enough slots were free in total.
        self.num_external_fragmentation_waits = 0

    def pool_snapshot(self) -> list[dict]:
        """The same per-block view as ``KVCacheManager.pool_snapshot``: a block is
        "used" by the one request whose reservation covers it, else "free"."""
        owner = {block: request_id for request_id, blocks in list(self.req_to_blocks.items()) for block in blocks}
        return [
            {"block_id": block, "state": "used" if block in owner else "free", "ref_cnt": int(block in owner),
             "owners": [owner[block]] if block in owner else [], "hashed": False, "block_hash": None}
            for block in range(self.num_blocks)
        ]

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_blocks_to_start(self, num_tokens: int) -> int:
        return self.num_blocks_for(num_tokens)

    def reset_peak_blocks_in_use(self) -> None:
        self.peak_blocks_in_use = self.num_blocks_in_use

    def reserve_for(self, request_id: str, num_tokens: int) -> None:
        """Per-request mode: the request will reserve ``num_tokens`` slots when admitted."""
        self._sizes[request_id] = self.num_blocks_for(num_tokens)

    def _size_of(self, request_id: str) -> int:
        if self.reservation_blocks is not None:
            return self.reservation_blocks
        if request_id not in self._sizes:
            raise ValueError(f"per-request reservations need reserve_for({request_id!r}, tokens) first")
        return self._sizes[request_id]

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """No cache hits. The scheduler calls this before admitting a request, so in
        per-request mode it is where the reservation size (prompt + max_tokens) is learnt."""
        if self.reservation_blocks is None:
            self.reserve_for(request.request_id, request.num_prompt_tokens + request.max_tokens)
        return PrefixHit([[]], 0)  # one KV cache group, no hit

    def admit(self, request: Request, first_chunk: FirstChunk) -> Admission | None:
        """Reserve the request's run for its first chunk (``admit_from_prefix``, with no hit)."""
        if request.lora is not None:
            raise ValueError(f"request {request.request_id!r} names LoRA adapter {request.lora.name!r}: adapters "
                             "are paged into the KV pool, which needs kv_layout='paged'")
        return admit_from_prefix(self, request, first_chunk)

    def admit_swapped(self, request: Request, num_new_tokens: int) -> tuple[list[SwapIn],
                                                                            list[BlockCopy]] | None:
        raise ValueError(f"request {request.request_id!r} is not swapped out: the contiguous layout never swaps")

    def take_adapter_loads(self) -> list[AdapterLoad]:
        return []  # no adapters (see ``admit``)

    def drop_adapter(self, name: str) -> None:
        return None  # no adapter is ever resident here

    def adapter_view(self) -> list[dict]:
        return []

    @property
    def num_adapter_page_ins(self) -> int:
        return 0

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """No prefix cache: nothing to count."""

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """No prefix cache: nothing to register."""

    def prefetch(self, request: Request) -> None:
        return  # no prefix cache, nothing to fetch

    def take_tier_moves(self) -> BlockMovePlan:
        return BlockMovePlan()  # no prefix cache, so no tiers below it

    def take_tail_changes(self) -> tuple[list[int], list[int]]:
        return [], []  # no tails: an int8 pool's partial blocks read as int8 (docs/paging.md)

    def reset_prefix_cache(self) -> int:
        return 0

    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int, computed_blocks: list | None = None
    ) -> list[BlockCopy] | None:
        """Reserve the request's run on first use (first fit), then only check
        that the tokens stay inside it. Returns [] (never copies) or None."""
        needed = self.num_blocks_for(num_computed_tokens + num_new_tokens)
        reservation = self.req_to_blocks.get(request_id)
        if reservation is not None:
            if needed > len(reservation):
                raise ValueError(f"request {request_id!r} outgrew its contiguous reservation of {len(reservation)} blocks")
            return []
        size = self._size_of(request_id)
        if needed > size:
            raise ValueError(f"request {request_id!r} needs {needed} blocks, more than its reservation of {size}")
        for index, (start, length) in enumerate(self.holes):
            if length >= size:
                if length == size:
                    del self.holes[index]
                else:
                    self.holes[index] = (start + size, length - size)
                self.req_to_blocks[request_id] = range(start, start + size)
                self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
                return []
        if self.num_free_blocks >= size:
            self.num_external_fragmentation_waits += 1
        return None

    def free(self, request_id: str) -> None:
        """Return the reservation as a hole, merged with adjacent holes."""
        self._sizes.pop(request_id, None)
        reservation = self.req_to_blocks.pop(request_id, None)
        if reservation is None:
            return
        start, length = reservation.start, len(reservation)
        index = bisect.bisect_left(self.holes, (start, 0))
        if index < len(self.holes) and self.holes[index][0] == start + length:
            length += self.holes.pop(index)[1]
        if index > 0 and sum(self.holes[index - 1]) == start:
            start, previous = self.holes[index - 1][0], self.holes[index - 1][1]
            length += previous
            index -= 1
            self.holes.pop(index)
        self.holes.insert(index, (start, length))

    def get_block_ids(self, request_id: str, start: int = 0) -> list[list[int]]:
        return [list(self.req_to_blocks.get(request_id, range(0))[start:])]  # one KV cache group

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Nothing to release: the reservation is held whole until the request ends."""
        return len(self.req_to_blocks.get(request_id, range(0)))

    def num_released(self, request_id: str) -> list[int]:
        return [0]  # one group; a reservation is held whole until the request ends

    def fork(self, parent_id: str, child_id: str) -> list[BlockCopy] | None:
        raise ValueError("the contiguous KV layout cannot fork sequences (n > 1, beam search); use kv_layout='paged'")

    def swap_out(self, request_id: str) -> list[SwapOut] | None:
        return None  # no swap space: the scheduler falls back to recompute

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.block_size, self.num_free_blocks, self.peak_blocks_in_use,
                            external_fragmentation_waits=self.num_external_fragmentation_waits)

    def check_invariants(self, running: Mapping[str, int], swapped: Collection[str]) -> None:
        """Reservations and holes tile the pool exactly, without overlap; only
        running requests hold reservations, each large enough for its tokens."""
        runs = sorted([(r.start, len(r)) for r in self.req_to_blocks.values()] + self.holes)
        at = 0
        for start, length in runs:
            if start != at or length <= 0:
                raise RuntimeError(f"contiguous pool is not tiled at block {at}: next run {(start, length)}")
            at = start + length
        if at != self.num_blocks:
            raise RuntimeError(f"contiguous pool covers {at} of {self.num_blocks} blocks")
        for (s1, l1), (s2, _) in zip(self.holes, self.holes[1:]):
            if s1 + l1 >= s2:
                raise RuntimeError("adjacent holes were not merged")
        for request_id, reservation in self.req_to_blocks.items():
            if request_id not in running:
                raise RuntimeError(f"request {request_id!r} holds a reservation but is not running")
            if self.num_blocks_for(running[request_id]) > len(reservation):
                raise RuntimeError(f"request {request_id!r} holds more tokens than its reservation")

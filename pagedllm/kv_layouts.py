"""The engine's KV allocators without a model, one per pool layout, for what-if replays
(``pagedllm bench fragmentation``): the same code that allocates a served pool's blocks,
behind the few operations a replay needs. Public so that the bench (which reads only
what a user can read) and users replay their own traces through the real allocators."""

from __future__ import annotations

from pagedllm.core.contiguous import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import KVGroupLayout, KVGroupSpec

CONTIGUOUS = "contiguous"
PAGED = "paged"
LAYOUTS = (CONTIGUOUS, PAGED)


class KVLayoutPool:
    """``num_blocks`` blocks of ``block_size`` tokens under one layout: ``contiguous``
    reserves a request's whole run at admission, ``paged`` takes a block at a time
    (prefix caching off: a replay measures layout, not sharing)."""

    def __init__(self, layout: str, num_blocks: int, block_size: int) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self._manager: ContiguousKVCacheManager | KVCacheManager
        if layout == CONTIGUOUS:
            # Per-request mode: every run is sized at admission by reserve_for.
            self._manager = ContiguousKVCacheManager(num_blocks, block_size, None)
        else:
            self._manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)

    def admit(self, request_id: str, num_tokens: int, reserved_tokens: int) -> bool:
        """Place a request's first ``num_tokens`` tokens (contiguous: reserving
        ``reserved_tokens`` slots for its run); False, changing nothing, if they do not fit."""
        if self.layout == CONTIGUOUS:
            self._manager.reserve_for(request_id, reserved_tokens)
        return self._manager.allocate_slots(request_id, 0, num_tokens) is not None

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """One more token after ``num_tokens``; False if it does not fit."""
        return self._manager.allocate_slots(request_id, num_tokens, 1) is not None

    def free(self, request_id: str) -> None:
        self._manager.free(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        (table,) = self._manager.get_block_ids(request_id)  # one KV cache group
        return table

    @property
    def num_free_blocks(self) -> int:
        return self._manager.num_free_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self._manager.num_blocks_in_use


def blocks_held(kv_groups: list[dict], num_tokens: int, block_size: int) -> int:
    """Pool blocks a sequence of ``num_tokens`` tokens keeps over the KV cache groups
    ``kv_groups`` (``kv_pool_snapshot()["kv_groups"]``) once its windows have moved on:
    the manager's own rule (``core.kv_groups``), for lengths a replay does not run."""
    groups = tuple(KVGroupSpec(group["kind"], tuple(group["layers"]), group["window"], group.get("chunk"))
                   for group in kv_groups)
    layout = KVGroupLayout(groups, sum(len(group.layers) for group in groups))
    return layout.blocks_held(num_tokens, block_size)

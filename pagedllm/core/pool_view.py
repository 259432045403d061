"""The live pool view of a paged KV manager: who holds each physical block
(``KVCacheManager.pool_snapshot``; the dashboard and ``/v1/kv_pool`` show it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.block_hash import external_block_hash
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_managers.tail_runs import TailRun

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_manager import KVCacheManager


def paged_pool_snapshot(kv: KVCacheManager) -> list[dict]:
    """Per physical block, for the live pool view: ``state`` ("used": some
    table points at it; "cached": free but hashed, so prefix caching can
    revive it until it is evicted; "free"), ``ref_cnt``, the ids of the
    requests whose tables hold it (a swapped request keeps the shared blocks
    it points at), ``hashed``, ``group`` (the KV cache group whose tables or
    cache hold it; None when free and uncached, an adapter page or a tail),
    ``adapter`` (the LoRA adapter whose weights it holds, if any: "used"
    while pinned, "cached" while idle) and ``tail`` (whether it is part of
    an int8 tail; its request is its owner). Safe to call while another thread
    steps the engine: each mapping is copied in one call, so the view may
    straddle a step but never raises."""
    owners: dict[int, list[str]] = {}
    group_of: dict[int, int] = {}
    for group in kv.groups:
        for request_id, table in list(group.tables.items()) + list(group.swapped_tables.items()):
            for block in list(table.entries):
                if isinstance(block, KVCacheBlock):
                    owners.setdefault(block.block_id, []).append(request_id)
                    group_of[block.block_id] = group.group
    for request_id, runs in list(kv.tails.held.items()):
        for block in (block for run in runs for block in run.blocks):
            owners[block.block_id] = [request_id]
    return [
        {
            "block_id": block.block_id,
            "state": "used" if block.ref_cnt else ("cached" if block.block_hash or block.owner else "free"),
            "ref_cnt": block.ref_cnt,
            "owners": owners.get(block.block_id, []),
            "hashed": block.block_hash is not None,
            # As KV events name it (``external_block_hash``), so a subscriber's view can be checked.
            "block_hash": None if block.block_hash is None else external_block_hash(block.block_hash),
            "group": group_of.get(block.block_id, None if block.block_hash is None else block.cache_group),
            "adapter": None if block.owner is None or isinstance(block.owner, TailRun) else block.owner.name,
            "tail": isinstance(block.owner, TailRun),
        }
        for block in kv.block_pool.blocks
    ]

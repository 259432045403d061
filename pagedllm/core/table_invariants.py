"""The paged KV cache manager's invariants, checked from outside (``debug_invariants``).

What must hold between steps:
- the block pool's free queue, ref counts and hash map agree (``BlockPool.check_invariants``);
- only running requests hold device tables, only swapped ones swapped tables,
  never both; host blocks are each used once and none leaks;
- a running table (``BlockTableRecord``) has at most ``ceil(num_tokens / block_size)``
  entries; its first ``num_released`` entries are None (released by the sliding
  window) and no more than the window of its ``num_tokens`` allows, every later
  entry holds a block; it registered no more entries than it has; an unfilled
  block is never hashed;
- every block's ref count equals the number of tables (device or swapped) that point at it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from pagedllm.core.sliding_window import num_out_of_window_blocks

if TYPE_CHECKING:
    from pagedllm.core.block_table import BlockTableRecord
    from pagedllm.core.kv_cache_manager import KVCacheManager


def check_paged_tables(manager: KVCacheManager, running: Mapping[str, int], swapped: Collection[str]) -> None:
    """Raise ``RuntimeError`` on the first broken invariant (see the module docstring)."""
    manager.block_pool.check_invariants()
    references: dict[int, int] = {}
    _check_swapped(manager, swapped, references)
    for request_id, record in manager.tables.items():
        if request_id not in running:
            raise RuntimeError(f"request {request_id!r} holds blocks but is not running")
        _check_table(manager, request_id, record, running[request_id])
        for block in record.entries:
            if block is not None:
                references[block.block_id] = references.get(block.block_id, 0) + 1
    for block in manager.block_pool.blocks:
        expected = references.get(block.block_id, 0)
        if block.ref_cnt != expected:
            raise RuntimeError(
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {expected} block tables point at it"
            )


def _check_swapped(manager: KVCacheManager, swapped: Collection[str], references: dict[int, int]) -> None:
    """Swapped tables belong to swapped requests only; count their resident blocks into ``references``."""
    host_blocks: list[int] = []
    for request_id, table in manager.swapped_tables.items():
        if request_id not in swapped:
            raise RuntimeError(f"request {request_id!r} has swapped blocks but is not swapped out")
        if request_id in manager.tables:
            raise RuntimeError(f"request {request_id!r} is both swapped out and resident")
        for entry in table.entries:
            if isinstance(entry, int):
                host_blocks.append(entry)
            elif entry is not None:
                references[entry.block_id] = references.get(entry.block_id, 0) + 1
    if len(set(host_blocks)) != len(host_blocks):
        raise RuntimeError("a host swap block is used twice")
    if len(host_blocks) + manager.swap_space.num_free_blocks != manager.swap_space.num_blocks:
        raise RuntimeError("host swap blocks leaked")


def _check_table(manager: KVCacheManager, request_id: str, record: BlockTableRecord, num_tokens: int) -> None:
    """One running request's table against its ``num_tokens``."""
    block_size, blocks, released = manager.block_size, record.entries, record.num_released
    limit = manager.num_blocks_for(num_tokens)
    if len(blocks) > limit:
        raise RuntimeError(f"request {request_id!r} holds {len(blocks)} blocks for {num_tokens} tokens (at most {limit})")
    if record.num_registered > len(blocks):
        raise RuntimeError(f"request {request_id!r} registered {record.num_registered} of its {len(blocks)} entries")
    if released > num_out_of_window_blocks(num_tokens, manager.sliding_window, block_size):
        raise RuntimeError(f"request {request_id!r} released {released} blocks, some still in its window")
    if any(block is not None for block in blocks[:released]) or any(block is None for block in blocks[released:]):
        raise RuntimeError(f"request {request_id!r}'s table is not {released} released entries then blocks")
    for index, block in enumerate(blocks[num_tokens // block_size :], num_tokens // block_size):
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is hashed but is request {request_id!r}'s unfilled block {index}")

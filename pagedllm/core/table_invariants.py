"""The paged KV cache manager's invariants, checked from outside (``debug_invariants``).

What must hold between steps, in every KV cache group:
- the block pool's free queue, ref counts and hash map agree (``BlockPool.check_invariants``);
- only running requests hold device tables, only swapped ones swapped tables,
  never both; host blocks are each used once (over every group) and none leaks;
- a running table (``BlockTableRecord``) has at most ``ceil(num_tokens / block_size)``
  entries, as many in every group; its first ``num_released`` entries are None
  (released by the group's sliding window or chunk: a full-attention group
  releases none) and no more than its kind allows at ``num_tokens``, every later
  entry holds a block; it registered no more entries than it has; an unfilled
  block is never hashed; a hashed block is cached under its own group's key;
- a block serves one group at a time, and its ref count equals the number of
  tables (device or swapped) that point at it; a LoRA adapter's page is in no
  table (``AdapterPages.check_invariants`` checks its pins).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.core.block_table import BlockTableRecord
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.single_type_manager import SingleTypeManager


def check_paged_tables(manager: KVCacheManager, running: Mapping[str, int], swapped: Collection[str]) -> None:
    """Raise ``RuntimeError`` on the first broken invariant (see the module docstring)."""
    manager.block_pool.check_invariants()
    references: dict[int, int] = {}
    group_of: dict[int, int] = {}
    host_blocks: list[int] = []
    for group in manager.groups:
        host_blocks += _check_swapped(group, swapped)
        for request_id, record in group.tables.items():
            if request_id not in running:
                raise RuntimeError(f"request {request_id!r} holds blocks in group {group.group} but is not running")
            _check_table(group, request_id, record, running[request_id])
            if len(record.entries) != len(manager.groups[0].entries(request_id)):
                raise RuntimeError(f"request {request_id!r}'s table in group {group.group} is not group 0's length")
        tables = list(group.tables.values()) + list(group.swapped_tables.values())
        for block in (entry for table in tables for entry in table.entries if isinstance(entry, KVCacheBlock)):
            if group_of.setdefault(block.block_id, group.group) != group.group:
                raise RuntimeError(f"block {block.block_id} serves groups {group_of[block.block_id]} and {group.group}")
            references[block.block_id] = references.get(block.block_id, 0) + 1
    if len(set(host_blocks)) != len(host_blocks):
        raise RuntimeError("a host swap block is used twice")
    if len(host_blocks) + manager.swap_space.num_free_blocks != manager.swap_space.num_blocks:
        raise RuntimeError("host swap blocks leaked")
    for block in manager.block_pool.blocks:
        expected = references.get(block.block_id, 0)
        if block.owner is not None:
            # A LoRA page: a pin holds it (``AdapterPages.check_invariants``), never a table.
            if expected:
                raise RuntimeError(f"block {block.block_id} is a page of LoRA adapter {block.owner.name!r} "
                                   "and in a block table")
            continue
        if block.ref_cnt != expected:
            raise RuntimeError(
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {expected} block tables point at it"
            )


def _check_swapped(group: SingleTypeManager, swapped: Collection[str]) -> list[int]:
    """Swapped tables belong to swapped requests only; returns their host blocks."""
    host_blocks: list[int] = []
    for request_id, table in group.swapped_tables.items():
        if request_id not in swapped:
            raise RuntimeError(f"request {request_id!r} has swapped blocks but is not swapped out")
        if request_id in group.tables:
            raise RuntimeError(f"request {request_id!r} is both swapped out and resident")
        host_blocks += [entry for entry in table.entries if isinstance(entry, int)]
    return host_blocks


def _check_table(group: SingleTypeManager, request_id: str, record: BlockTableRecord, num_tokens: int) -> None:
    """One running request's table in one group against its ``num_tokens``."""
    block_size, blocks, released = group.block_size, record.entries, record.num_released
    limit = cdiv(num_tokens, block_size)
    where = f"request {request_id!r} (group {group.group})"
    if len(blocks) > limit:
        raise RuntimeError(f"{where} holds {len(blocks)} blocks for {num_tokens} tokens (at most {limit})")
    if record.num_registered > len(blocks):
        raise RuntimeError(f"{where} registered {record.num_registered} of its {len(blocks)} entries")
    if released > group.num_releasable(num_tokens):
        raise RuntimeError(f"{where} released {released} blocks, some still read ({group.attention.describe()})")
    if any(block is not None for block in blocks[:released]) or any(block is None for block in blocks[released:]):
        raise RuntimeError(f"{where}'s table is not {released} released entries then blocks")
    for index, block in enumerate(blocks[released:], released):
        if block.block_hash is not None and block.cache_group != group.group:
            raise RuntimeError(f"block {block.block_id} of {where} is cached in group {block.cache_group}")
        if block.block_hash is not None and index >= num_tokens // block_size:
            raise RuntimeError(f"block {block.block_id} is hashed but is {where}'s unfilled block {index}")

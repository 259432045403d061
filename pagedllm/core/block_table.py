"""One request's block table as the paged KV cache manager keeps it.

A resident request has one ``BlockTableRecord``: its entries and the two
counts that must move with them (how many leading entries the sliding window
released, how many are registered in the prefix cache), so they can never
fall out of step. A swapped-out request has a ``SwappedTable`` instead, never
both: its entries are partly host block ids, no method that grows, registers
or reads a device table may see it, and it keeps only the released count
(its blocks come back unregistered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.block_pool import KVCacheBlock

# A table entry: a block, or None once it fell out of the sliding window.
TableEntry = KVCacheBlock | None
# A swapped-out table entry: a resident (shared) block, the id of a host block, or None.
SwappedEntry = KVCacheBlock | int | None


@dataclass
class BlockTableRecord:
    """A resident request's table. Its first ``num_released`` entries are None
    and every later one holds a block; its first ``num_registered`` entries
    (released ones included) were registered in the prefix cache."""

    entries: list[TableEntry] = field(default_factory=list)
    num_released: int = 0
    num_registered: int = 0

    def blocks(self) -> list[KVCacheBlock]:
        """The blocks the table holds, in table order (released entries skipped)."""
        return self.entries[self.num_released :]


@dataclass
class SwappedTable:
    """A swapped-out request's table: its private blocks' host ids in place of
    the blocks, the shared blocks it still references, and its released entries."""

    entries: list[SwappedEntry]
    num_released: int = 0

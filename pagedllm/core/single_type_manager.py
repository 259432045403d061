"""One KV cache group's block tables: full attention, a sliding window or chunked local
attention, each kind's release and hit rules its own (``core/kv_managers/``; vLLM v1's
single-type managers).

The coordinator (``core/kv_cache_manager.py``) keeps one ``SingleTypeManager``
per group of ``core.kv_groups`` over one shared ``BlockPool``; it decides what a
step may take from the pool across every group, and this class carries it out
for its group's tables. Token ``t`` of a request lives, in this group, in slot
``entries[t // block_size] * block_size + t % block_size`` of its table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.block_table import BlockTableRecord, SwappedTable, TableEntry
from pagedllm.core.kv_interface import NULL_BLOCK_ID, BlockCopy
from pagedllm.core.kv_managers.kinds import AttentionKind
from pagedllm.core.prefix_cache import HitEntry, PrefixCache
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


class AllocationPlan(NamedTuple):
    """What ``adopt_hit`` and ``grow`` will do for one group, counted before anything changes."""

    num_released: int  # the new table's leading entries a cached hit leaves released
    num_from_pool: int  # of the hit's kept entries, the leading run the pool holds (registered already)
    num_new_blocks: int
    needs_copy: bool  # the write lands in a shared block: copy-on-write
    cost: int  # free blocks the allocation takes (new, copy, revived cached, tier loads)


class SingleTypeManager:
    """The block tables of one KV cache group, whose ``attention`` kind says which entries
    no later query reads.

    Safety rules (the coordinator keeps the cross-group ones):
    - Only a table's last block is ever written, and never while it is shared:
      writing into a block with ``ref_cnt > 1`` first replaces it by a copy.
    - Tables only grow at the tail while a request lives (``truncate`` cuts back
      only blocks a step just took), to ``ceil(num_tokens / block_size)`` entries,
      the same in every group. With a window or a chunk, the leading entries no
      query will read again (the kind's ``num_released``) are released, in order,
      and become None, never to be filled again: only the last
      ``ceil(span / block_size) + 1`` entries (plus a step's new ones) hold blocks. A released block keeps its hash, so it stays
      in the prefix cache until evicted.
    - A block sits in one group's tables or cache at a time: it comes from the
      pool unhashed, and is cached under this group's key only.
    """

    def __init__(self, group: int, attention: AttentionKind, block_size: int, prefix_cache: PrefixCache,
                 enable_block_sharing: bool) -> None:
        self.group = group
        self.attention = attention
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.block_pool = prefix_cache.block_pool
        self.enable_block_sharing = enable_block_sharing
        # Each resident request's table, and each swapped-out one's (never both).
        self.tables: dict[str, BlockTableRecord] = {}
        self.swapped_tables: dict[str, SwappedTable] = {}

    def num_releasable(self, num_tokens: int) -> int:
        """Leading entries no query from position ``num_tokens`` on reads (0: full attention)."""
        return self.attention.num_released(num_tokens, self.block_size)

    def release_unread(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the entries no query from ``num_computed_tokens`` on reads (None
        entries stay None), last first like ``free``: each drops one reference.
        Nothing reads them again, so this is never undone."""
        record = self.tables.get(request_id)
        if record is None:
            return
        num_released = min(self.num_releasable(num_computed_tokens), len(record.entries))
        start = record.num_released
        if num_released <= start:
            return
        self.block_pool.free_blocks(reversed(record.entries[start:num_released]))
        record.entries[start:num_released] = [None] * (num_released - start)
        record.num_released = num_released

    def plan(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
             hit: list[HitEntry]) -> AllocationPlan:
        """Count what ``adopt_hit`` and ``grow`` take for this group (no change). ``hit`` (this
        group's entries of a ``PrefixHit``) goes only to a request with no table."""
        record = self.tables.get(request_id)
        blocks = record.entries if record is not None else []
        if hit and blocks:
            raise ValueError(f"request {request_id!r} already has blocks; cached blocks go only to a new table")
        leading = next((i for i, entry in enumerate(hit) if entry is not None), len(hit))
        released = min(max(leading, self.num_releasable(num_computed_tokens)), len(hit))
        kept = hit[released:]
        if any(entry is None for entry in kept):
            raise ValueError(f"request {request_id!r}'s cached blocks in group {self.group} have a hole")
        num_new_blocks = max(0, cdiv(num_computed_tokens + num_new_tokens, self.block_size) - len(blocks) - len(hit))
        write_index = num_computed_tokens // self.block_size
        needs_copy = write_index < len(blocks) and blocks[write_index].ref_cnt > 1
        num_from_pool = next((i for i, entry in enumerate(kept) if not isinstance(entry, KVCacheBlock)), len(kept))
        # A full group's tier hits follow its pool run; a sliding or chunked one's may fall between pool blocks.
        pooled = [entry for entry in kept if isinstance(entry, KVCacheBlock)]
        revived = sum(1 for block in pooled if block.ref_cnt == 0)
        cost = num_new_blocks + needs_copy + revived + len(kept) - len(pooled)
        return AllocationPlan(released, num_from_pool, num_new_blocks, needs_copy, cost)

    def adopt_hit(self, request_id: str, hit: list[HitEntry], plan: AllocationPlan) -> None:
        """Give ``hit``'s cached blocks one more reference each (reviving them out of
        the free queue; no-op for a request that has a table). The coordinator does
        this for every group before any group takes a fresh block (``load_hit``,
        ``grow``), which could otherwise evict another group's cached hit."""
        if request_id not in self.tables:
            self.block_pool.touch(entry for entry in hit[plan.num_released:] if isinstance(entry, KVCacheBlock))

    def load_hit(self, request_id: str, hit: list[HitEntry], plan: AllocationPlan) -> None:
        """Make ``hit`` (adopted) the head of a new table, its tier hits loaded into
        fresh blocks (no-op for a request that has a table)."""
        if request_id in self.tables:
            return
        kept = hit[plan.num_released:]
        # Loaded blocks are registered by the step's cache_full_blocks, which knows their tokens.
        loaded = iter(self.prefix_cache.load_from_tiers(
            [entry for entry in kept if not isinstance(entry, KVCacheBlock)], self.group))
        entries: list[TableEntry] = [None] * plan.num_released
        entries += [entry if isinstance(entry, KVCacheBlock) else next(loaded) for entry in kept]
        self.tables[request_id] = BlockTableRecord(entries, plan.num_released, plan.num_released + plan.num_from_pool)

    def grow(self, request_id: str, num_computed_tokens: int, plan: AllocationPlan) -> list[BlockCopy]:
        """Carry out the rest of ``plan`` (the coordinator checked its cost against
        the free blocks): a shared write target is copied, the table grows.
        Returns the copy owed, if any."""
        blocks = self.tables[request_id].entries
        copies = []
        if plan.needs_copy:
            write_index = num_computed_tokens // self.block_size
            shared = blocks[write_index]
            (private,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([shared])  # drops our reference only
            blocks[write_index] = private
            copies.append(BlockCopy(shared.block_id, private.block_id, write_index, self.group))
        blocks.extend(self.block_pool.get_new_blocks(plan.num_new_blocks))
        return copies

    def register(self, request: Request, num_tokens: int) -> None:
        """Cache the full blocks of the request's first ``num_tokens`` tokens in this group."""
        record = self.tables.get(request.request_id)
        if record is not None:
            self.prefix_cache.register(request, record, num_tokens, self.group)

    def num_released(self, request_id: str) -> int:
        """Leading entries released by the window or chunk (a swapped-out request's too)."""
        record = self.tables.get(request_id) or self.swapped_tables.get(request_id)
        return record.num_released if record is not None else 0

    def private_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The resident request's blocks no other table shares (what a swap-out moves)."""
        record = self.tables.get(request_id, BlockTableRecord())
        return [block for block in record.blocks() if block.ref_cnt == 1]

    def swap_out(self, request_id: str, to_host: dict[KVCacheBlock, int]) -> None:
        """Replace the private blocks by their host blocks (``to_host``) and free
        them; shared blocks stay resident with the request's reference.
        Swapped-in copies come back unhashed: the registered count is dropped."""
        record = self.tables.pop(request_id, BlockTableRecord())
        private = [block for block in record.blocks() if block in to_host]
        self.swapped_tables[request_id] = SwappedTable([to_host.get(block, block) for block in record.entries],
                                                       record.num_released)
        self.block_pool.free_blocks(reversed(private))

    def num_host_blocks(self, request_id: str) -> int:
        return sum(1 for entry in self.swapped_tables[request_id].entries if isinstance(entry, int))

    def swap_in_cost(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks ``swap_in`` plus the next ``allocate`` take in this group."""
        table = self.swapped_tables[request_id].entries
        new_blocks = max(0, cdiv(num_computed_tokens + num_new_tokens, self.block_size) - len(table))
        write_index = num_computed_tokens // self.block_size
        entry = table[write_index] if write_index < len(table) else None
        shared_tail = isinstance(entry, KVCacheBlock) and entry.ref_cnt > 1
        return self.num_host_blocks(request_id) + new_blocks + shared_tail

    def swap_in(self, request_id: str, fresh: Iterator[KVCacheBlock]) -> list[tuple[int, int]]:
        """Put a fresh device block (from ``fresh``) in place of each host block;
        returns the ``(host block, device block)`` copies. Released entries stay released."""
        swapped = self.swapped_tables.pop(request_id)
        blocks: list[TableEntry] = []
        copies = []
        for entry in swapped.entries:
            if isinstance(entry, int):
                block = next(fresh)
                copies.append((entry, block.block_id))
                entry = block
            blocks.append(entry)
        self.tables[request_id] = BlockTableRecord(blocks, swapped.num_released)
        return copies

    def fork_cost(self, parent_id: str) -> int:
        """Free blocks ``fork`` takes: none with sharing, else one per held block."""
        held = self.tables.get(parent_id, BlockTableRecord()).blocks()
        return 0 if self.enable_block_sharing else len(held)

    def fork(self, parent_id: str, child_id: str) -> list[BlockCopy]:
        """Give ``child_id`` the parent's table: shared (one more reference per
        block) or, without sharing, private copies returned as block copies."""
        if child_id in self.tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        parent = self.tables.get(parent_id, BlockTableRecord())
        released, held = parent.num_released, parent.blocks()  # the child's released entries are the parent's
        if self.enable_block_sharing:
            self.block_pool.touch(held)
            self.tables[child_id] = BlockTableRecord(list(parent.entries), released, parent.num_registered)
            return []
        child_blocks = self.block_pool.get_new_blocks(len(held))
        self.tables[child_id] = BlockTableRecord([None] * released + child_blocks, released)
        return [BlockCopy(src.block_id, dst.block_id, index, self.group)
                for index, (src, dst) in enumerate(zip(held, child_blocks), released)]

    def free(self, request_id: str) -> list[int]:
        """Release the request's blocks (tail first); returns the host blocks of
        its swapped table, if it had one, for the coordinator to free."""
        record = self.tables.pop(request_id, None)
        entries = record.entries if record is not None else []
        swapped = self.swapped_tables.pop(request_id, None)
        host = []
        if swapped is not None:
            host = [entry for entry in swapped.entries if isinstance(entry, int)]
            entries = [entry for entry in swapped.entries if not isinstance(entry, int)]
        self.block_pool.free_blocks(reversed([block for block in entries if block is not None]))
        return host

    def truncate(self, request_id: str, num_entries: int) -> int:
        """Release the entries past ``num_entries``, last first: the blocks of
        rejected draft tokens (never registered: drafts are never cached)."""
        blocks = self.entries(request_id)
        if len(blocks) > num_entries:
            self.block_pool.free_blocks(reversed(blocks[num_entries:]))
            del blocks[num_entries:]
        return len(blocks)

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Block ids of the resident table from entry ``start`` on (``NULL_BLOCK_ID`` if released)."""
        blocks = self.entries(request_id)
        return [NULL_BLOCK_ID if (block := blocks[index]) is None else block.block_id
                for index in range(start, len(blocks))]

    def entries(self, request_id: str) -> list[TableEntry]:
        """The resident request's table entries (empty for any other request)."""
        record = self.tables.get(request_id)
        return record.entries if record is not None else []

"""Block tables: which physical blocks hold each request's tokens.

Token ``t`` of a request lives in slot
``block_table[t // block_size] * block_size + t % block_size``. With a sliding
window the leading entries that fell out of it are None: released, owning nothing.
"""

from __future__ import annotations

from pagedllm.core.block_hash import BlockHash, external_block_hash
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.block_table import BlockTableRecord, SwappedTable, TableEntry
from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.kv_interface import NULL_BLOCK_ID, BlockCopy, KVCacheStats, PrefixHit
from pagedllm.core.prefix_cache import PrefixCache
from pagedllm.core.request import Request
from pagedllm.core.sliding_window import num_out_of_window_blocks
from pagedllm.core.swap_space import SwapSpace
from pagedllm.core.table_invariants import check_paged_tables
from pagedllm.core.tier_index import TierCounters, TierIndex, TierMoves
from collections.abc import Collection, Mapping

from pagedllm.utils import cdiv, check_block_size


class KVCacheManager:
    """Allocates blocks on demand and frees them when a request ends
    (implements ``KVCacheManagerProtocol``).

    Safety rules:
    - ``allocate_slots`` is all-or-nothing: it counts the blocks a step needs
      (including a copy-on-write block) before mutating anything and returns
      None on shortfall, so the scheduler can preempt and retry without undoing
      a half-made allocation.
    - Only a table's last block is ever written, and never while it is shared:
      writing into a block with ``ref_cnt > 1`` first replaces it by a copy.
      Reads never check sharing.
    - Block tables only grow at the tail while a request lives (``truncate``,
      a speculative rollback, cuts back only blocks a step just took); a block is
      taken only when the previous last block is full, so a table never holds
      more than ``ceil(num_tokens / block_size)`` entries and waste per request
      is at most ``block_size - 1`` slots. With ``sliding_window`` (every layer
      slides with that window) the leading entries no query will read again
      are released at the start of ``allocate_slots`` and become None, in
      order, never to be filled again: only the last
      ``ceil(sliding_window / block_size) + 1`` entries (plus a step's new
      ones) hold blocks. A released block keeps its hash, so it stays in the
      prefix cache until evicted.
    - ``free`` releases tail-first, so (once prefix caching keeps freed blocks
      around) a shared prefix is evicted after the private tails that follow it.
    - Lookups and registration are the ``PrefixCache``'s (with ``tiers``, it
      reaches below the pool); a tier hit takes a fresh block, counted like
      any other before anything changes, into which its bytes are loaded.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_block_sharing: bool = True,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        sliding_window: int | None = None,
        tiers: TierIndex | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        check_block_size(block_size)
        if tiers is not None and (sliding_window is not None or not enable_prefix_caching):
            raise ValueError("KV offload tiers hold prefix-cache blocks: they need enable_prefix_caching and a "
                             "model without a sliding window")
        self.block_size = block_size
        self.tiers = tiers
        self.prefix_cache = PrefixCache(num_blocks, block_size, enable_prefix_caching, tiers, events)
        self.block_pool = self.prefix_cache.block_pool
        # Each resident request's table, and each swapped-out one's (never both: ``block_table``).
        self.tables: dict[str, BlockTableRecord] = {}
        self.swapped_tables: dict[str, SwappedTable] = {}
        # The window every layer shares (None: keep every block).
        self.sliding_window = sliding_window
        self.peak_blocks_in_use = 0
        # False only for the no-sharing baseline of `pagedllm bench sharing`.
        self.enable_block_sharing = enable_block_sharing
        self.swap_space = SwapSpace(num_swap_blocks)
        self.num_swap_out_blocks = 0
        self.num_swap_in_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.block_pool.num_cached_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def reset_peak_blocks_in_use(self) -> None:
        """Start a new peak measurement from the blocks in use now."""
        self.peak_blocks_in_use = self.num_blocks_in_use

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The request's cached prefix in the pool and the tiers (``PrefixCache.lookup``)."""
        return self.prefix_cache.lookup(request)

    def prefetch(self, request: Request) -> None:
        """A new request: its prefix may start coming up from the disk tier now."""
        self.prefix_cache.prefetch(request)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (in tokens)."""
        self.prefix_cache.record_lookup(num_tokens, num_hit_tokens)

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock | BlockHash] | None = None,
    ) -> list[BlockCopy] | None:
        """Make room to write tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

        ``computed_blocks`` (from ``get_computed_blocks``, for a request with no
        table yet) become the head of the table with one more reference each;
        cached free ones are revived, and count against the free blocks, as do
        the tier hits among them (hashes), each loaded into a fresh block.
        Grows the table with fresh blocks and, if the first token lands in a
        block shared with another table (a partly filled tail after a fork),
        replaces that entry by a private copy: copy-on-write. Returns the
        block copies the model runner must perform before the forward pass (at
        most one, whatever the sequence length, and only ever of the entry at
        ``num_computed_tokens // block_size``), or None if the pool is short;
        on None nothing was added. Either way, first releases the entries out
        of the sliding window of ``num_computed_tokens`` (nothing reads them
        again, so that is never undone), and cached blocks already out of it
        are not taken at all (their entries start as None).
        """
        computed_blocks = computed_blocks or []
        record = self.tables.get(request_id)
        blocks = record.entries if record is not None else []
        if computed_blocks and blocks:
            raise ValueError(f"request {request_id!r} already has blocks; cached blocks go only to a new table")
        released = num_out_of_window_blocks(num_computed_tokens, self.sliding_window, self.block_size)
        self._release_out_of_window(request_id, released)
        kept = computed_blocks[released:]
        held = len(blocks) + len(computed_blocks)
        num_new_blocks = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - held)
        write_index = num_computed_tokens // self.block_size
        needs_copy = write_index < len(blocks) and blocks[write_index].ref_cnt > 1
        num_from_pool = next((i for i, b in enumerate(kept) if not isinstance(b, KVCacheBlock)), len(kept))
        revived = sum(1 for block in kept[:num_from_pool] if block.ref_cnt == 0)
        num_loads = len(kept) - num_from_pool
        if num_new_blocks + needs_copy + revived + num_loads > self.num_free_blocks:
            return None
        if record is None:  # a new table: the cached blocks are registered, those out of the window released
            pooled = kept[:num_from_pool]
            self.block_pool.touch(pooled)
            loaded = self.prefix_cache.load_from_tiers(kept[num_from_pool:])
            num_released = len(computed_blocks) - len(kept)
            # Loaded blocks are registered by the step's cache_full_blocks, which knows their tokens.
            record = self.tables[request_id] = BlockTableRecord([None] * num_released + pooled + loaded,
                                                                num_released, num_released + len(pooled))
        blocks = record.entries
        copies = []
        if needs_copy:
            shared = blocks[write_index]
            (private,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([shared])  # drops our reference only
            blocks[write_index] = private
            copies.append(BlockCopy(shared.block_id, private.block_id, write_index))
        blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
        return copies

    def take_tier_moves(self) -> TierMoves:
        return self.prefix_cache.take_tier_moves()

    def _release_out_of_window(self, request_id: str, num_released: int) -> None:
        """Release the request's table entries before ``num_released`` (None
        entries stay None), last first like ``free``: each drops one reference."""
        record = self.tables.get(request_id)
        if record is None or num_released <= record.num_released:
            return
        start, num_released = record.num_released, min(num_released, len(record.entries))
        self.block_pool.free_blocks(reversed(record.entries[start:num_released]))
        record.entries[start:num_released] = [None] * (num_released - start)
        record.num_released = num_released

    def num_released(self, request_id: str) -> int:
        """Leading entries of the request's table released by the sliding window
        (a swapped-out request's too: they stay released)."""
        record = self.tables.get(request_id) or self.swapped_tables.get(request_id)
        return record.num_released if record is not None else 0

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that the request's first ``num_tokens`` tokens fill,
        so later requests with the same prefix find them.

        The scheduler calls this right after allocating a step, before the
        forward pass: a request admitted later in the same step may then hit a
        block whose K/V this very pass writes. That is safe because attention
        writes every new token's K/V of a layer before any query of that layer
        reads, and a block in use (ref_cnt > 0) is never evicted.
        """
        record = self.tables.get(request.request_id)
        if record is not None:
            self.prefix_cache.register(request, record, num_tokens)

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset()

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's private blocks to host memory and free them.

        Blocks shared with another table stay resident (the request keeps its
        reference), so a preempted sibling never takes memory from the others.
        Returns the ``(device block, host block)`` copies to perform before the
        next forward pass, or None (nothing changed) if the host pool is short.
        """
        record = self.tables.get(request_id, BlockTableRecord())
        private = [block for block in record.blocks() if block.ref_cnt == 1]
        host_blocks = self.swap_space.allocate(len(private))
        if host_blocks is None:
            return None
        to_host: dict[KVCacheBlock, int] = dict(zip(private, host_blocks))
        # Swapped-in copies come back unhashed: the registered count is dropped here.
        self.swapped_tables[request_id] = SwappedTable([to_host.get(block, block) for block in record.entries],
                                                       record.num_released)
        self.tables.pop(request_id, None)
        self.block_pool.free_blocks(reversed(private))
        self.num_swap_out_blocks += len(private)
        return [(block.block_id, host) for block, host in to_host.items()]

    def swap_in_cost(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks that ``swap_in`` followed by ``allocate_slots(num_computed_tokens,
        num_new_tokens)`` will take, so the scheduler can check before doing either."""
        table = self.swapped_tables[request_id].entries
        host = sum(1 for entry in table if isinstance(entry, int))
        new_blocks = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table))
        write_index = num_computed_tokens // self.block_size
        shared_tail = (
            write_index < len(table)
            and not isinstance(table[write_index], int)
            and table[write_index].ref_cnt > 1
        )
        return host + new_blocks + shared_tail

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request's blocks back into fresh device blocks.
        Returns the ``(host block, device block)`` copies, or None if the pool is short.
        Released (None) entries stay released."""
        swapped = self.swapped_tables[request_id]
        host_blocks = [entry for entry in swapped.entries if isinstance(entry, int)]
        if len(host_blocks) > self.num_free_blocks:
            return None
        fresh = iter(self.block_pool.get_new_blocks(len(host_blocks)))
        blocks: list[TableEntry] = []
        copies = []
        for entry in swapped.entries:
            if isinstance(entry, int):
                block = next(fresh)
                copies.append((entry, block.block_id))
                entry = block
            blocks.append(entry)
        del self.swapped_tables[request_id]
        self.tables[request_id] = BlockTableRecord(blocks, swapped.num_released)
        self.swap_space.free(host_blocks)
        self.num_swap_in_blocks += len(host_blocks)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
        return copies

    def fork(self, parent_id: str, child_id: str) -> list[BlockCopy] | None:
        """Give ``child_id`` the parent's block table.

        With block sharing (the normal case) the child points at the parent's
        blocks and each block's count goes up: no data moves, and a later write
        into a shared tail is copied on write. Without it (the benchmarks'
        baseline) the child gets private copies of every block, returned as
        block copies, or None if the pool is short.
        """
        if child_id in self.tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        parent = self.tables.get(parent_id, BlockTableRecord())
        released, held = parent.num_released, parent.blocks()  # the child's released entries are the parent's
        if self.enable_block_sharing:
            self.block_pool.touch(held)
            self.tables[child_id] = BlockTableRecord(list(parent.entries), released, parent.num_registered)
            return []
        if len(held) > self.num_free_blocks:
            return None
        child_blocks = self.block_pool.get_new_blocks(len(held))
        self.tables[child_id] = BlockTableRecord([None] * released + child_blocks, released)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
        return [
            BlockCopy(src.block_id, dst.block_id, index)
            for index, (src, dst) in enumerate(zip(held, child_blocks), released)
        ]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first). Freeing an unknown request is a no-op,
        so every finish/abort/preempt path can call it unconditionally."""
        entries = self._entries(request_id)
        self.tables.pop(request_id, None)
        swapped = self.swapped_tables.pop(request_id, None)
        if swapped is not None:
            self.swap_space.free([entry for entry in swapped.entries if isinstance(entry, int)])
            entries = [entry for entry in swapped.entries if not isinstance(entry, int)]
        self.block_pool.free_blocks(reversed([block for block in entries if block is not None]))

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Release the table entries past what ``num_tokens`` tokens need, last
        first: the blocks of rejected draft tokens. They hold no registered
        (hashed) block, since drafts are never cached; returns the entries kept."""
        blocks = self._entries(request_id)
        keep = self.num_blocks_for(num_tokens)
        if len(blocks) > keep:
            self.block_pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
        return len(blocks)

    def pool_snapshot(self) -> list[dict]:
        """Per physical block, for the live pool view: ``state`` ("used": some
        table points at it; "cached": free but hashed, so prefix caching can
        revive it until it is evicted; "free"), ``ref_cnt``, the ids of the
        requests whose tables hold it (a swapped request keeps the shared blocks
        it points at), ``hashed``, and ``adapter`` (the LoRA adapter whose weights
        it holds, if any: "used" while pinned, "cached" while idle). Safe to call while another thread steps
        the engine: each mapping is copied in one call, so the view may straddle
        a step but never raises."""
        owners: dict[int, list[str]] = {}
        tables = list(self.tables.items()) + list(self.swapped_tables.items())
        for request_id, table in tables:
            for block in list(table.entries):
                if isinstance(block, KVCacheBlock):
                    owners.setdefault(block.block_id, []).append(request_id)
        return [
            {
                "block_id": block.block_id,
                "state": "used" if block.ref_cnt else ("cached" if block.block_hash or block.adapter_name else "free"),
                "ref_cnt": block.ref_cnt,
                "owners": owners.get(block.block_id, []),
                "hashed": block.block_hash is not None,
                # As KV events name it (``external_block_hash``), so a subscriber's view can be checked.
                "block_hash": None if block.block_hash is None else external_block_hash(block.block_hash),
                "adapter": block.adapter_name,
            }
            for block in self.block_pool.blocks
        ]

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Block ids of the request's table from entry ``start`` on (the scheduler
        sends a running request's new entries only, so this stays O(new));
        released entries read ``NULL_BLOCK_ID``."""
        blocks = self._entries(request_id)
        return [NULL_BLOCK_ID if (block := blocks[index]) is None else block.block_id
                for index in range(start, len(blocks))]

    def _entries(self, request_id: str) -> list[TableEntry]:
        """The resident request's table entries (empty for any other request)."""
        record = self.tables.get(request_id)
        return record.entries if record is not None else []

    def stats(self) -> KVCacheStats:
        tiers = self.tiers.counters if self.tiers is not None else TierCounters()
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=self.num_free_blocks,
            peak_blocks_in_use=self.peak_blocks_in_use,
            num_cached_blocks=self.num_cached_blocks,
            prefix_cache_queries=self.prefix_cache.queries,
            prefix_cache_hits=self.prefix_cache.hits,
            num_swap_blocks=self.swap_space.num_blocks,
            swap_out_blocks=self.num_swap_out_blocks,
            swap_in_blocks=self.num_swap_in_blocks,
            host_tier_blocks=self.tiers.num_host_blocks if self.tiers is not None else 0,
            host_tier_hits=tiers.host_hits,
            disk_tier_hits=tiers.disk_hits,
            tier_offloads=tiers.offloads,
            tier_persists=tiers.persists,
            tier_fetches=tiers.fetches,
            tier_fetch_failures=tiers.fetch_failures,
        )  # external_fragmentation_waits stays 0: paging never refuses what free blocks would fit

    def check_invariants(self, running: Mapping[str, int], swapped: Collection[str]) -> None:
        """Raise ``RuntimeError`` on the first broken invariant (see the protocol
        and ``table_invariants``)."""
        check_paged_tables(self, running, swapped)
        if self.tiers is not None:
            self.tiers.check_invariants()

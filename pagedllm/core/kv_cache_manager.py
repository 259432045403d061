"""The KV cache coordinator: one shared block pool, one block table per request
in each KV cache group (vLLM v1's ``KVCacheCoordinator``).

Each group of ``core.kv_groups`` (full attention, a sliding window or chunked local
attention) has a
``SingleTypeManager`` that keeps its tables; this class decides, across every
group at once, what a step may take from the pool, so each call stays
all-or-nothing. Token ``t`` of a request lives, in group ``g``, in slot
``tables[g][t // block_size] * block_size + t % block_size``; a sliding or chunked
group's leading entries that no later query reads are None (released).
Beside the groups, the adapter-pages kind (``kv_managers.adapter_pages``) holds
the LoRA adapters' pages in the same pool, pinned for the requests that hold
device blocks under them, and the tail kind (``kv_managers.tail_runs``) an int8
pool's full-precision tails, held by the requests that write.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from pagedllm.core.block_moves import AdapterLoad, BlockMovePlan, SwapIn, SwapOut
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.kv_interface import Admission, BlockCopy, FirstChunk, KVCacheStats, PrefixHit, admit_from_prefix
from pagedllm.core.kv_managers.adapter_pages import AdapterPages
from pagedllm.core.kv_managers.kinds import LayerAttention, attention_of
from pagedllm.core.kv_managers.tail_runs import TailRuns
from pagedllm.core.pool_view import paged_pool_snapshot
from pagedllm.core.prefix_cache import PrefixCache
from pagedllm.core.request import Request
from pagedllm.core.single_type_manager import HitEntry, SingleTypeManager
from pagedllm.core.swap_space import SwapSpace
from pagedllm.core.table_invariants import check_paged_tables
from pagedllm.core.tier_index import TierCounters, TierIndex
from pagedllm.utils import cdiv, check_block_size

class KVCacheManager:
    """Allocates blocks on demand in every KV cache group and frees them when a
    request ends (implements ``KVCacheManagerProtocol``).

    Safety rules:
    - ``allocate_slots``, ``fork`` and ``swap_in`` are all-or-nothing across
      groups: every group's cost (new blocks, a copy-on-write block, revived
      cached blocks, tier loads) is counted against the shared free count before
      any group changes, and on shortfall they return None with nothing added.
      Releasing blocks behind a window or chunk comes first: nothing reads them again.
    - Every group's table of a request has the same length (entries aligned by
      logical block), so the runner reads them side by side.
    - A block serves one group at a time: taken from the pool it is unhashed,
      and each group caches under its own key (the same tokens are other K/V
      in another group). KV events announce group 0's blocks only.
    - ``free`` releases each group's table tail-first, so a shared prefix is
      evicted after the private tails that follow it.
    - The offload tiers keep each group's blocks under (group, hash), as the
      pool does: a tier hit counts toward a group's hit like a cached block of
      that group (``PrefixCache.lookup``), and is loaded into a fresh block.
    - A request under a LoRA adapter holds the adapter's pages (``AdapterPages``)
      exactly while it holds device blocks: ``admit`` pins the adapter before the
      prefix lookup (a page-in may evict cached blocks, perhaps the very hit) and
      unpins it when the blocks do not fit; ``free`` and ``swap_out`` unpin.
    - An int8 pool's tails (``TailRuns``) are blocks like the others: a request
      takes them where it starts writing (its first
      ``allocate_slots``, from blocks other than its prefix hit; ``admit_swapped``;
      a fork's child at its first growth) within the same all-or-nothing count,
      and gives them back where its device blocks go (``free``, ``swap_out``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_block_sharing: bool = True,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        windows: Sequence[LayerAttention] = (None,),
        tiers: TierIndex | None = None,
        events: KVEventLog | None = None,
        enable_lora: bool = False,
        max_loras: int | None = None,
        tail_run_blocks: int = 0,
        tails_per_request: int = 0,
    ) -> None:
        check_block_size(block_size)
        if not windows:
            raise ValueError("the KV cache manager needs at least one KV cache group")
        if tiers is not None and not enable_prefix_caching:
            raise ValueError("KV offload tiers hold prefix-cache blocks: they need enable_prefix_caching")
        self.block_size = block_size
        self.tiers = tiers
        # Each group's attention kind, spelt as a layer's (``core.kv_managers.kinds``).
        kinds = [attention_of(window) for window in windows]
        self.prefix_cache = PrefixCache(num_blocks, block_size, enable_prefix_caching, tiers, events, kinds)
        self.block_pool = self.prefix_cache.block_pool
        self.groups = [SingleTypeManager(group, kind, block_size, self.prefix_cache, enable_block_sharing)
                       for group, kind in enumerate(kinds)]
        self.peak_blocks_in_use = 0
        self.adapters = AdapterPages(self.block_pool, max_loras, enabled=enable_lora)
        self.tails = TailRuns(self.block_pool, tail_run_blocks, tails_per_request)
        self.swap_space = SwapSpace(num_swap_blocks)
        self.num_swap_out_blocks = 0
        self.num_swap_in_blocks = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

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

    def _note_peak(self) -> None:
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)

    def reset_peak_blocks_in_use(self) -> None:
        """Start a new peak measurement from the blocks in use now."""
        self.peak_blocks_in_use = self.num_blocks_in_use

    def num_blocks_for(self, num_tokens: int) -> int:
        """Entries one group's table has for ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_to_start(self, num_tokens: int) -> int:
        # A step holds, in every group, each block it writes: a sliding or chunked
        # group releases what it no longer reads only before a step, and its queries read
        # the step's own earlier tokens. It also takes its tails.
        return len(self.groups) * self.num_blocks_for(num_tokens) + self.tails.blocks_per_request

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The request's cached prefix, per group, in the pool and the tiers (``PrefixCache.lookup``)."""
        return self.prefix_cache.lookup(request)

    def prefetch(self, request: Request) -> None:
        """A new request: its prefix may start coming up from the disk tier now."""
        self.prefix_cache.prefetch(request)

    def admit(self, request: Request, first_chunk: FirstChunk) -> Admission | None:
        """Pin the request's adapter (paging it in, which may evict cached blocks),
        then look its prefix up and allocate its first chunk and its tails
        (``admit_from_prefix``); None, with the pin released, when any of it does
        not fit. A page-in made for it stays, idle: its load is still owed, so a
        revival reads the weights."""
        if not self.adapters.pin(request.request_id, request.lora):
            return None
        admitted = admit_from_prefix(self, request, first_chunk)
        if admitted is None:
            self.adapters.unpin(request.request_id)
        return admitted

    def admit_swapped(self, request: Request, num_new_tokens: int) -> tuple[list[SwapIn],
                                                                            list[BlockCopy]] | None:
        """Pin the request's adapter and take its tails (first, as ``admit`` does),
        bring its blocks back and allocate its next ``num_new_tokens`` tokens; None
        with nothing changed but an idle page-in when they do not fit."""
        request_id, num_computed = request.request_id, request.num_computed_tokens
        if not self.adapters.pin(request_id, request.lora):
            return None
        if not self.tails.hold(request_id) or \
                self.swap_in_cost(request_id, num_computed, num_new_tokens) > self.num_free_blocks:
            self.tails.release(request_id)
            self.adapters.unpin(request_id)
            return None
        moves = self.swap_in(request_id)
        copies = self.allocate_slots(request_id, num_computed, num_new_tokens)
        if moves is None or copies is None:
            raise RuntimeError(f"request {request_id!r}: swap_in_cost undercounted its swap-in")
        return moves, copies

    def take_adapter_loads(self) -> list[AdapterLoad]:
        return self.adapters.take_loads()

    def drop_adapter(self, name: str) -> None:
        self.adapters.drop(name)

    def adapter_view(self) -> list[dict]:
        return self.adapters.view()

    @property
    def num_adapter_page_ins(self) -> int:
        return self.adapters.num_page_ins

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (in tokens)."""
        self.prefix_cache.record_lookup(num_tokens, num_hit_tokens)

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: list[list[HitEntry]] | None = None,
    ) -> list[BlockCopy] | None:
        """Make room to write tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``
        in every group.

        ``computed_blocks`` (a ``PrefixHit``'s per-group lists, for a request
        with no table yet) become the head of each group's table with one more
        reference each; cached free ones are revived, and count against the free
        blocks, as do the tier hits among them (hashes), each loaded into a
        fresh block. Grows the tables with fresh blocks and, where the first
        token lands in a block shared with another table (a partly filled tail
        after a fork), replaces that entry by a private copy: copy-on-write.
        Returns the block copies the runner must perform before the forward
        pass (at most one per group, only ever of the entry at
        ``num_computed_tokens // block_size``), or None if the pool is short; on
        None nothing was added. Either way, first releases each sliding or chunked
        group's entries that no query from ``num_computed_tokens`` on reads.
        A request without its tails (a new one, a fork's child) takes them first,
        from blocks other than its hit's (taking may evict cached blocks).
        """
        hits = computed_blocks or [[] for _ in self.groups]
        for group in self.groups:
            group.release_unread(request_id, num_computed_tokens)
        had_tails = request_id in self.tails.held
        hit_blocks = {entry.block_id for hit in hits for entry in hit if isinstance(entry, KVCacheBlock)}
        if not self.tails.hold(request_id, avoid=hit_blocks):
            return None
        plans = [group.plan(request_id, num_computed_tokens, num_new_tokens, hit)
                 for group, hit in zip(self.groups, hits)]
        if sum(plan.cost for plan in plans) > self.num_free_blocks:
            if not had_tails:
                self.tails.release(request_id)
            return None
        # Every group revives its cached hit before any takes a fresh block (a tier
        # load's or a new one): taking one may evict a free cached block, which must
        # not be another group's hit.
        for group, hit, plan in zip(self.groups, hits, plans):
            group.adopt_hit(request_id, hit, plan)
        for group, hit, plan in zip(self.groups, hits, plans):
            group.load_hit(request_id, hit, plan)
        copies = [copy for group, plan in zip(self.groups, plans)
                  for copy in group.grow(request_id, num_computed_tokens, plan)]
        self._note_peak()
        return copies

    def take_tier_moves(self) -> BlockMovePlan:
        return self.prefix_cache.take_tier_moves()

    def take_tail_changes(self) -> tuple[list[int], list[int]]:
        return self.tails.take_changes()

    def num_released(self, request_id: str) -> list[int]:
        """Per group, the leading entries of the request's table its window or
        chunk released (a swapped-out request's too: they stay released)."""
        return [group.num_released(request_id) for group in self.groups]

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register, in every group, the blocks that the request's first
        ``num_tokens`` tokens fill, so later requests with the same prefix find them.

        The scheduler calls this right after allocating a step, before the
        forward pass: a request admitted later in the same step may then hit a
        block whose K/V this very pass writes. That is safe because attention
        writes every new token's K/V of a layer before any query of that layer
        reads, and a block in use (ref_cnt > 0) is never evicted.
        """
        for group in self.groups:
            group.register(request, num_tokens)

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset()

    def swap_out(self, request_id: str) -> list[SwapOut] | None:
        """Move the request's private blocks (of every group) to host memory and free them.

        Blocks shared with another table stay resident (the request keeps its
        reference), so a preempted sibling never takes memory from the others.
        Returns the swap-outs to perform before the next forward pass, or None
        (nothing changed) if the host pool is short. The request's adapter pin
        and tails go with its device blocks (the runner copies a tail out
        before anything reuses its run: ``core.block_moves.Phase``).
        """
        private = [block for group in self.groups for block in group.private_blocks(request_id)]
        host_blocks = self.swap_space.allocate(len(private))
        if host_blocks is None:
            return None
        to_host: dict[KVCacheBlock, int] = dict(zip(private, host_blocks))
        for group in self.groups:
            group.swap_out(request_id, to_host)
        self.tails.release(request_id)
        self.adapters.unpin(request_id)
        self.num_swap_out_blocks += len(private)
        return [SwapOut(block.block_id, host) for block, host in to_host.items()]

    def swap_in_cost(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks that ``swap_in`` followed by ``allocate_slots(num_computed_tokens,
        num_new_tokens)`` will take, so the scheduler can check before doing either."""
        return sum(group.swap_in_cost(request_id, num_computed_tokens, num_new_tokens) for group in self.groups)

    def swap_in(self, request_id: str) -> list[SwapIn] | None:
        """Bring a swapped request's blocks back into fresh device blocks.
        Returns the swap-ins, or None if the pool is short.
        Released (None) entries stay released."""
        needed = sum(group.num_host_blocks(request_id) for group in self.groups)
        if needed > self.num_free_blocks:
            return None
        fresh = iter(self.block_pool.get_new_blocks(needed))
        copies = [SwapIn(*copy) for group in self.groups for copy in group.swap_in(request_id, fresh)]
        self.swap_space.free([host for host, _ in copies])
        self.num_swap_in_blocks += needed
        self._note_peak()
        return copies

    def fork(self, parent_id: str, child_id: str) -> list[BlockCopy] | None:
        """Give ``child_id`` the parent's tables.

        With block sharing (the normal case) the child points at the parent's
        blocks and each block's count goes up: no data moves, and a later write
        into a shared tail is copied on write. Without it (the benchmarks'
        baseline) the child gets private copies of every block, returned as
        block copies, or None if the pool is short.
        """
        if sum(group.fork_cost(parent_id) for group in self.groups) > self.num_free_blocks:
            return None
        copies = [copy for group in self.groups for copy in group.fork(parent_id, child_id)]
        self.adapters.share(parent_id, child_id)
        self._note_peak()
        return copies

    def free(self, request_id: str) -> None:
        """Release the request's blocks (each group tail first), host blocks, tails
        and then its adapter pin (the pages join the LRU after the blocks). Freeing
        an unknown request is a no-op, so every finish/abort/preempt path can
        call it unconditionally."""
        for group in self.groups:
            self.swap_space.free(group.free(request_id))
        self.tails.release(request_id)
        self.adapters.unpin(request_id)

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Release the table entries past what ``num_tokens`` tokens need, in every
        group, last first: the blocks of rejected draft tokens. They hold no
        registered (hashed) block, since drafts are never cached; returns the
        entries kept (the same in every group)."""
        keep = self.num_blocks_for(num_tokens)
        return min(group.truncate(request_id, keep) for group in self.groups)

    def pool_snapshot(self) -> list[dict]:
        """Per physical block, for the live pool view (``core.pool_view.paged_pool_snapshot``)."""
        return paged_pool_snapshot(self)

    def get_block_ids(self, request_id: str, start: int = 0) -> list[list[int]]:
        """Per group, the block ids of the request's table from entry ``start`` on
        (the scheduler sends a running request's new entries only, so this stays
        O(new)); released entries read ``NULL_BLOCK_ID``."""
        return [group.get_block_ids(request_id, start) for group in self.groups]

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
            tier_hit_tokens=tiers.hit_tokens,
        )  # external_fragmentation_waits stays 0: paging never refuses what free blocks would fit

    def check_invariants(self, running: Mapping[str, int], swapped: Collection[str]) -> None:
        """Raise ``RuntimeError`` on the first broken invariant (see the protocol
        and ``table_invariants``)."""
        check_paged_tables(self, running, swapped)
        self.adapters.check_invariants(self.groups[0].tables)
        self.tails.check_invariants(self.groups[0].tables)
        if self.tiers is not None:
            self.tiers.check_invariants()

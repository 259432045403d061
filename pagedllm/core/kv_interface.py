"""The boundary between the scheduler and a KV cache manager.

``KVCacheManagerProtocol`` lists exactly what the scheduler (and the engine's
stats) call. Two managers implement it: the paged ``KVCacheManager`` (blocks on
demand, sharing, prefix cache, swap) and the ``ContiguousKVCacheManager``
baseline (one first-fit reservation per request). Each checks its own
invariants; neither carries attributes that exist only for the other's callers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.block_moves import AdapterLoad, BlockMovePlan, SwapIn, SwapOut


# The block id the runner's tables hold for an entry the sliding window released.
# The same filler the decode tables are padded with: no reader reaches such an
# entry (windowed attention starts at the window's first block), and if one did
# its positions are masked, so which block it names never matters. No block is
# reserved for it: the pool keeps all its blocks.
NULL_BLOCK_ID = 0


class BlockCopy(NamedTuple):
    """Copy physical block ``src`` into ``dst`` before the next forward pass
    (every slot cache's row: a block serves one group at a time); ``dst``
    becomes entry ``table_index`` of the requesting sequence's table of KV
    cache group ``group`` (copy-on-write of a shared tail, or a fork when
    sharing is off)."""

    src: int
    dst: int
    table_index: int
    group: int = 0


class PrefixHit(NamedTuple):
    """What a prefix lookup found: ``blocks``, one list per KV cache group, each
    covering ``num_tokens`` tokens (cached pool blocks and the hashes of blocks
    a tier will load: in a full-attention group the hashes follow the blocks, in
    a sliding group they may fall between them; a sliding group's leading entries
    outside the window of the hit point are None), and whether more of the prefix is ``loading`` from
    disk (wait for it). No hit: one empty list per group."""

    blocks: list[list[Any]]
    num_tokens: int
    loading: bool = False


class Admission(NamedTuple):
    """A request admitted from its prefix: ``num_computed_tokens`` its cached prefix
    covers, ``num_new_tokens`` to compute this step, the ``copies`` its allocation owes."""

    num_computed_tokens: int
    num_new_tokens: int
    copies: list[BlockCopy]


# Given the tokens a request's cached prefix covers, how many to compute this step,
# or None when the scheduler's budget cannot take its first chunk now.
FirstChunk = Callable[[int], "int | None"]


def admit_from_prefix(kv: KVCacheManagerProtocol, request: Request, first_chunk: FirstChunk) -> Admission | None:
    """Look the request's prefix up and allocate its first chunk behind it; None
    (nothing allocated) while its prefix is loading from a tier, or when the chunk
    or its blocks do not fit. The steps of every manager's ``admit``."""
    computed_blocks, num_cached, loading = kv.get_computed_blocks(request)
    if loading:  # its prefix is coming from disk: admitted once it has landed
        return None
    num_new = first_chunk(num_cached)
    if num_new is None:
        return None
    copies = kv.allocate_slots(request.request_id, num_cached, num_new, computed_blocks)
    if copies is None:
        return None
    kv.record_lookup(request.num_tokens, num_cached)
    return Admission(num_cached, num_new, copies)


@dataclass(frozen=True)
class KVCacheStats:
    """A manager's counters at one moment (all in blocks unless named otherwise)."""

    num_blocks: int
    block_size: int
    num_free_blocks: int
    peak_blocks_in_use: int
    # What a manager without a prefix cache, swap space or holes leaves at 0.
    num_cached_blocks: int = 0
    # Prefix-cache lookups of admitted requests, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_swap_blocks: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    # Admissions refused although enough blocks were free in total (contiguous only).
    external_fragmentation_waits: int = 0
    # The tiers below the pool (``core/tier_index.py``), in blocks.
    host_tier_blocks: int = 0
    host_tier_hits: int = 0
    disk_tier_hits: int = 0
    tier_offloads: int = 0
    tier_persists: int = 0
    tier_fetches: int = 0
    tier_fetch_failures: int = 0
    tier_hit_tokens: int = 0  # prompt tokens the tiers supplied (the hits count every group's blocks)

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_blocks_in_use / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class KVCacheManagerProtocol(Protocol):
    """What the scheduler needs from a KV cache manager (and the steps of ``admit``).

    Safety rules every implementation keeps:
    - ``admit``, ``admit_swapped``, ``allocate_slots`` and ``fork`` are
      all-or-nothing: on shortfall they return None and the request holds
      nothing new, so the scheduler can preempt and retry.
    - A request under a LoRA adapter holds its adapter's pages exactly while it
      holds device blocks: ``admit`` and ``admit_swapped`` pin them with the
      blocks, ``fork`` for the child, ``swap_out`` and ``free`` release them.
    - ``free`` is idempotent (unknown ids are a no-op), so every finish, abort
      and preemption path may call it unconditionally.
    - Block copies returned by any call must be executed by the runner before
      the next forward pass, in the order returned.
    """

    block_size: int

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def admit(self, request: Request, first_chunk: FirstChunk) -> Admission | None:
        """Start (or restart) a waiting request from its cached prefix, with its
        adapter's pages (``admit_from_prefix``); None: it waits."""

    def admit_swapped(self, request: Request, num_new_tokens: int) -> tuple[list[SwapIn],
                                                                            list[BlockCopy]] | None:
        """Bring a swapped request back (``(host, device)`` copies) with its
        adapter's pages, and allocate its next ``num_new_tokens`` tokens; None: it waits."""

    def take_adapter_loads(self) -> list[AdapterLoad]:
        """The adapter page-ins since the last call, for this step's output (the runner writes them)."""

    def drop_adapter(self, name: str) -> None:
        """An adapter is unloaded: its idle pages stop being revivable (``ValueError`` while pinned)."""

    def adapter_view(self) -> list[dict]:
        """The resident adapters (name, pages, first block, pins), for the live pool view."""

    @property
    def num_adapter_page_ins(self) -> int: ...

    def num_blocks_to_start(self, num_tokens: int) -> int:
        """Pool blocks a request with nothing computed takes for its first
        ``num_tokens`` tokens in one step (over every KV cache group)."""

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Cached blocks of the request's prefix, the tokens they cover, and
        whether more are loading from a tier."""

    def prefetch(self, request: Request) -> None:
        """A request arrived: start bringing its prefix up from slow tiers (no-op without them)."""

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup."""

    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
        computed_blocks: list[list[Any]] | None = None,
    ) -> list[BlockCopy] | None:
        """Room to write the next ``num_new_tokens`` tokens, or None if the pool is short."""

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks of the first ``num_tokens`` tokens for prefix reuse."""

    def fork(self, parent_id: str, child_id: str) -> list[BlockCopy] | None:
        """Give ``child_id`` the parent's table (shared, or copied when sharing is off)."""

    def swap_out(self, request_id: str) -> list[SwapOut] | None:
        """Move the request's private blocks to host memory (releasing its adapter pin):
        the swap-outs, or None."""

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first), host blocks and adapter pin."""

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Keep only the table entries ``num_tokens`` tokens need (a speculative
        rollback); returns the entries kept."""

    def get_block_ids(self, request_id: str, start: int = 0) -> list[list[int]]:
        """Physical block ids of the request's tables from entry ``start`` on, one
        list per KV cache group, all of one length (``NULL_BLOCK_ID`` for released
        entries)."""

    def num_released(self, request_id: str) -> list[int]:
        """Per KV cache group, the leading entries of the request's table released
        by the group's sliding window (they stay released while the request lives)."""

    def reset_prefix_cache(self) -> int:
        """Forget cached blocks no request uses; returns how many."""

    def take_tier_moves(self) -> BlockMovePlan:
        """The tier moves owed since the last call, for this step's plan (empty without tiers)."""

    def take_tail_changes(self) -> tuple[list[int], list[int]]:
        """``(taken, given back)`` int8 tail slots since the last call, for this
        step's output (``kv_managers.tail_runs``; empty without tails)."""

    def reset_peak_blocks_in_use(self) -> None:
        """Start a new peak measurement from the blocks in use now."""

    def stats(self) -> KVCacheStats: ...

    def pool_snapshot(self) -> list[dict]:
        """Per physical block: state, ref count, owners, hashed (the live pool view)."""

    def check_invariants(self, running: Mapping[str, int], swapped: Collection[str]) -> None:
        """Raise ``RuntimeError`` on the first broken invariant. ``running`` maps
        each running sequence to its token count (only those may hold device
        tables, no longer than their tokens need); ``swapped`` lists the
        sequences that may hold swapped-out tables."""

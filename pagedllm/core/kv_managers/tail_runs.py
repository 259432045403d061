"""The tail kind: an int8 pool's full-precision tails as owned runs of the one
shared block pool (issue 55). The coordinator (``core/kv_cache_manager.py``)
drives it beside its KV cache groups, as it drives the adapters' pages.

A tail keeps a still-filling block's tokens in the model's dtype
(``attention/kv_cache.py``, "Full-precision tails"). It takes ``run_blocks``
consecutive int8 blocks, the first a multiple of ``run_blocks``: in every
layer, the key (value) bytes of those blocks are the tail's keys (values), so
tail slot ``s`` is blocks ``[s * run_blocks, (s + 1) * run_blocks)`` and the
worker's tail tensors are views over the pool (``allocate_layer``). A block of
the model's dtype holds ``run_blocks`` times an int8 block's values
(``run_blocks`` is the dtype's size in bytes); the run's scales go unused.

A request holds ``per_request`` tails (one per KV cache group for the block it
fills, plus those one step's draft tokens reach past it: ``tails_per_request``)
while it holds device blocks and writes: taken when it is admitted (from
blocks other than its prefix hit, which taking may otherwise evict), swapped
in, or first scheduled after a fork, given back when it finishes, is preempted
or swapped out. The runner decides which of its blocks uses which of the granted
slots (``worker/tail_slots.py``); the scheduler only ever sees blocks, so a
request that cannot get its tails waits or preempts like any block shortage.

Safety rules:
- ``hold`` is all-or-nothing: every run of the request, or none.
- Runs are aligned, so a pool with free blocks may still hold no free run
  (fragmentation): ``hold`` then fails as a short pool does, and preempting
  frees runs; with nothing else running every free block is free, so a
  request alone finds its runs whenever ``run_blocks * per_request`` blocks
  beside its own fit (the admission check counts them: ``blocks_per_request``).
- A held run's blocks have one reference and the run as owner; a given-back run
  is disowned and freed (plain free blocks), so the pool never calls
  ``evicted`` on a run.
- ``take_changes`` reports each slot taken and given back since the last call,
  in the order the runner must apply them (given back first).
"""

from __future__ import annotations

from collections.abc import Collection

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.utils import cdiv


def tails_per_request(num_groups: int, block_size: int, num_speculative_tokens: int) -> int:
    """Tails one running request holds: one per group for the block it fills, plus
    those one step's draft tokens can reach past it."""
    return num_groups * (1 + cdiv(num_speculative_tokens, block_size))


def tails_pay(num_blocks: int, tail_blocks: int, unquantized_blocks: int) -> bool:
    """Whether an int8 pool of ``num_blocks`` blocks keeps full-precision tails
    of ``tail_blocks`` blocks a writing request, where the same memory holds
    ``unquantized_blocks`` blocks in the model's dtype: only if a request alone,
    beside its tails, still has more blocks than that pool would.

    A tail is an accuracy aid, not needed for correctness (every token is also
    written to the int8 pool, its scale fixed when it is written), so a pool too
    small for tails to pay runs without them and holds more tokens than the
    model's dtype would; one that has them keeps more beside a request's tails.
    The plan decides once per engine (``worker/memory.plan_kv_pool``), never per
    request, so a request's tokens never depend on how busy the pool is."""
    return num_blocks - tail_blocks > unquantized_blocks


class TailRun:
    """One held tail: the ``BlockOwner`` of its run of blocks."""

    __slots__ = ("request_id", "blocks")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.blocks: list[KVCacheBlock] = []

    @property
    def name(self) -> str:
        return f"tail of {self.request_id}"

    def evicted(self, block: KVCacheBlock) -> None:
        raise RuntimeError(f"block {block.block_id} of a {self.name} was reused while held")


class TailRuns:
    """The tails each request holds (none when ``run_blocks`` or ``per_request`` is 0)."""

    def __init__(self, pool: BlockPool, run_blocks: int = 0, per_request: int = 0) -> None:
        self.pool = pool
        self.run_blocks = run_blocks
        self.per_request = per_request if run_blocks else 0
        self.held: dict[str, list[TailRun]] = {}
        self._taken: list[int] = []
        self._returned: list[int] = []

    @property
    def blocks_per_request(self) -> int:
        """Pool blocks a writing request's tails take."""
        return self.run_blocks * self.per_request

    def slot_of(self, run: TailRun) -> int:
        return run.blocks[0].block_id // self.run_blocks

    def hold(self, request_id: str, avoid: Collection[int] = ()) -> bool:
        """Give ``request_id`` its tails if it holds none, from no block in ``avoid``;
        False (nothing taken) when the pool has no free aligned runs for all of them."""
        if not self.per_request or request_id in self.held:
            return True
        runs = []
        for _ in range(self.per_request):
            run = TailRun(request_id)
            blocks = self.pool.take_run(self.run_blocks, run, align=self.run_blocks, avoid=avoid)
            if blocks is None:
                self._give_back(runs)
                return False
            run.blocks = blocks
            runs.append(run)
            self._taken.append(self.slot_of(run))
        self.held[request_id] = runs
        return True

    def release(self, request_id: str) -> None:
        """The request stopped writing (finished, preempted, swapped out): its
        tails go back to the pool; a no-op for a request that holds none."""
        self._give_back(self.held.pop(request_id, []))

    def _give_back(self, runs: list[TailRun]) -> None:
        for run in runs:
            slot = self.slot_of(run)
            if slot in self._taken:  # taken since the runner last heard: it never needs to
                self._taken.remove(slot)
            else:
                self._returned.append(slot)
            self.pool.disown(run.blocks)
            self.pool.free_blocks(run.blocks)

    def take_changes(self) -> tuple[list[int], list[int]]:
        """``(taken, given back)`` tail slots since the last call (the runner applies
        the given-back ones first: a slot may be given back and taken again)."""
        changes = (self._taken, self._returned)
        self._taken, self._returned = [], []
        return changes

    def check_invariants(self, holders: Collection[str]) -> None:
        """Raise ``RuntimeError`` if a run and its blocks disagree, a request without
        device blocks (outside ``holders``) holds tails, or a block is owned by a run
        nobody holds."""
        runs = set()
        for request_id, held in self.held.items():
            if request_id not in holders:
                raise RuntimeError(f"request {request_id!r} holds tails but no blocks")
            if len(held) != self.per_request:
                raise RuntimeError(f"request {request_id!r} holds {len(held)} tails, not {self.per_request}")
            for run in held:
                runs.add(id(run))
                first = run.blocks[0].block_id
                if first % self.run_blocks or [b.block_id for b in run.blocks] != list(
                        range(first, first + self.run_blocks)):
                    raise RuntimeError(f"the {run.name} is not an aligned run: {run.blocks}")
                for block in run.blocks:
                    if block.owner is not run or block.ref_cnt != 1 or block.block_hash is not None:
                        raise RuntimeError(f"block {block.block_id} of a {run.name} has owner {block.owner!r}, "
                                           f"ref_cnt {block.ref_cnt}, hash {block.block_hash}")
        for block in self.pool.blocks:
            if isinstance(block.owner, TailRun) and id(block.owner) not in runs:
                raise RuntimeError(f"block {block.block_id} is owned by a {block.owner.name} nobody holds")

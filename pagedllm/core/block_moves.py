"""One step's KV block moves as one typed plan, and the order they run in.

Everything that moves a block's bytes in a step is a record here: copy-on-write
copies, preemption swaps, the tiers' offloads, loads, drops and persists, LoRA
adapters' page-ins, and (added by the runner, ``worker/tail_slots.py``) an int8
pool's tail-slot moves. A tail slot is a run of pool blocks
(``core/kv_managers/tail_runs.py``), so tail moves and block moves touch the
same bytes and their order matters as much.
The scheduler, the KV manager and the tier index add records to a
``BlockMovePlan``; the worker's ``BlockMover`` carries it out phase by phase.

``Phase`` is the order, stated once. Why each phase sits where it does:

- ``TIER_OFFLOAD`` first: a block the pool evicted this step is about to be
  reused (as a copy, swap-in or load destination, or by the forward).
- ``SWAP_OUT`` before ``COPY`` and ``SWAP_IN``: a block freed by a swap-out may
  be reused as a copy or swap-in destination in the same step.
- ``COPY``: every source is read before any destination is written, so the
  copies of one step never see each other's results.
- ``TIER_LOAD`` after the swap-ins (its destination may be a block freed by a
  swap-out), and ``TIER_DROP`` after the loads: an entry loaded and dropped in
  one step is still there for its load. An offload always makes a new entry,
  so an offload and a load in one step never clash.
- Every move that reads what this step frees runs before any that writes: a
  tail's run given back this step (a finished, preempted or swapped-out
  request's) may be reused this step as a copy, swap-in or load destination,
  another tail or an adapter's pages. So ``TAIL_OUT`` (a swapped-out block's
  tail to the host) and ``TAIL_COPY`` (a copied block's tail, and a tail moved
  off a slot given back) follow the swap-outs, whose blocks a newly taken
  tail may be, and precede ``COPY``. Tails back in and fills come after the
  block moves: a fill reads a block's int8 values as they left them.
- ``ADAPTER_LOAD`` after every block move: an adapter's pages may be blocks
  the pool evicted (or a swap-out freed) this step, so their old contents must
  have moved out first; the forward after it reads the new weights.
- ``FORWARD`` holds no records: it is where the step's forward pass runs.
- ``TIER_PERSIST`` after it: a newly cached block's K/V exist only once the
  forward wrote them.

Safety rule: records of one phase run as one batch, in the order they were
added; nothing orders moves across phases but ``Phase``.

Pure Python and plain data (tuples, lists, a dict), so a plan pickles to a
tensor-parallel worker like the lists it replaced. An empty plan is an empty
dict: building, testing and merging one costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import IntEnum
from typing import NamedTuple, TypeVar, Union

from pagedllm.core.block_hash import BlockHash


class Phase(IntEnum):
    """The order a step's moves run in (the module docstring says why)."""

    TIER_OFFLOAD = 0
    SWAP_OUT = 1
    TAIL_OUT = 2
    TAIL_COPY = 3
    COPY = 4
    SWAP_IN = 5
    TIER_LOAD = 6
    TIER_DROP = 7
    TAIL_IN = 8
    TAIL_FILL = 9
    ADAPTER_LOAD = 10
    FORWARD = 11
    TIER_PERSIST = 12


class TierOffload(NamedTuple):
    """Pool block -> a new host tier entry named ``key`` (``core.tier_index.tier_key``)."""

    block: int
    key: BlockHash
    PHASE = Phase.TIER_OFFLOAD


class SwapOut(NamedTuple):
    """Device block -> host swap block (``core.swap_space``)."""

    device: int
    host: int
    PHASE = Phase.SWAP_OUT


class CopyBlock(NamedTuple):
    """Device block -> device block (every slot cache's row)."""

    src: int
    dst: int
    PHASE = Phase.COPY


class SwapIn(NamedTuple):
    """Host swap block -> device block."""

    host: int
    device: int
    PHASE = Phase.SWAP_IN


class TierLoad(NamedTuple):
    """Host tier entry -> pool block."""

    key: BlockHash
    block: int
    PHASE = Phase.TIER_LOAD


class TierDrop(NamedTuple):
    """Forget a host tier entry."""

    key: BlockHash
    PHASE = Phase.TIER_DROP


class TailOut(NamedTuple):
    """An int8 pool's full-precision tail slot -> beside host swap block ``host``."""

    slot: int
    host: int
    PHASE = Phase.TAIL_OUT


class TailCopy(NamedTuple):
    """Tail slot -> tail slot (a copied block's tail)."""

    src: int
    dst: int
    PHASE = Phase.TAIL_COPY


class TailIn(NamedTuple):
    """The tail kept beside host swap block ``host`` -> tail slot."""

    host: int
    slot: int
    PHASE = Phase.TAIL_IN


class TailFill(NamedTuple):
    """Tail slot filled from ``block``'s int8 values."""

    block: int
    slot: int
    PHASE = Phase.TAIL_FILL


class AdapterLoad(NamedTuple):
    """A LoRA adapter's page-in: read ``path`` into the pages from ``first_block`` on
    (``lora/page_layout.py`` says what goes where)."""

    name: str
    path: str
    first_block: int
    PHASE = Phase.ADAPTER_LOAD


class TierPersist(NamedTuple):
    """Pool block -> a disk tier file named ``key`` (written behind the step)."""

    block: int
    key: BlockHash
    PHASE = Phase.TIER_PERSIST


BlockMove = Union[TierOffload, SwapOut, CopyBlock, SwapIn, TierLoad, TierDrop, TailOut, TailCopy, TailIn, TailFill,
                  AdapterLoad, TierPersist]
M = TypeVar("M", bound=tuple)


class BlockMovePlan:
    """A step's moves, kept per phase (only the phases that have any)."""

    __slots__ = ("_moves",)

    def __init__(self, moves: Iterable[BlockMove] = ()) -> None:
        self._moves: dict[Phase, list[BlockMove]] = {}
        self.add_all(moves)

    def add(self, move: BlockMove) -> None:
        self._moves.setdefault(move.PHASE, []).append(move)

    def add_all(self, moves: Iterable[BlockMove]) -> None:
        for move in moves:
            self.add(move)

    def extend(self, other: BlockMovePlan) -> None:
        """Append ``other``'s moves, phase by phase, after this plan's."""
        for phase, moves in other._moves.items():
            self._moves.setdefault(phase, []).extend(moves)

    def copy(self) -> BlockMovePlan:
        plan = BlockMovePlan()
        plan._moves = {phase: list(moves) for phase, moves in self._moves.items()}
        return plan

    def of(self, kind: type[M]) -> list[M]:
        """The moves of one record type, in the order added (a new list)."""
        return list(self._moves.get(kind.PHASE, ()))

    def phases(self, before: Phase | None = None, after: Phase | None = None) -> Iterator[tuple[Phase, list]]:
        """``(phase, moves)`` of each non-empty phase, in ``Phase`` order, limited to
        the phases strictly ``before`` / ``after`` the given ones."""
        for phase in sorted(self._moves):
            if (before is None or phase < before) and (after is None or phase > after):
                yield phase, self._moves[phase]

    def __bool__(self) -> bool:
        return bool(self._moves)

    def __len__(self) -> int:
        return sum(map(len, self._moves.values()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockMovePlan) and self._moves == other._moves

    def __repr__(self) -> str:
        return f"BlockMovePlan({[move for _, moves in self.phases() for move in moves]!r})"

    # A tuple, never falsy: pickle skips ``__setstate__`` for a falsy state (an empty plan).
    def __getstate__(self) -> tuple[dict[Phase, list[BlockMove]]]:
        return (self._moves,)

    def __setstate__(self, state: tuple[dict[Phase, list[BlockMove]]]) -> None:
        (self._moves,) = state

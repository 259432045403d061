"""Which physical block's full-precision tail is in which tail slot (int8 pools).

The readers' rule is in ``pagedllm.attention.kv_cache`` ("Full-precision
tails"): a query reads its own block at full precision unless it sits at the
block's last position. The slots are runs of the pool's blocks that the
scheduler's requests hold (``core/kv_managers/tail_runs.py``); each step's
output says which slots were taken and given back. This module decides, on the
driver, which blocks use which of the slots held, and each step's tail writes
and moves (``TailSlots.plan``, which the runner calls with the step's
scheduler output and host arrays).

Safety rules:

* A block gets a slot when this step writes a token into it that a later
  query will read at full precision: a decode row's token (single-token spans
  and draft tokens) not at the block's last position, and a prefill span's
  tokens in its last block when that block is not full after the span. A
  prefill span reads its own tokens fresh, so its earlier blocks need none.
* A block that gets a slot it did not have has the slot filled from its int8
  values first (``tail_fills``): tokens written while it had none (a
  swapped-in block) read exactly as stored, never a stale tail.
* Slots are released only at the start of a step, from committed state: a slot
  stays while its block is, in a live sequence's table, the block its
  committed length (``num_computed_tokens``) ends in, when that is not full;
  for a sequence not scheduled this step, whose committed length is only known
  to lie between that of its latest step and what that step wrote, every block
  in between. A speculative rollback truncates the table past the committed
  tokens, so the block they end in keeps its tail; a draft that filled a block
  frees nothing; a block another sequence left keeps no stale slot.
* A prefill span that starts in a partial block and ends in another hands the
  first block's slot on to its last (the first is full after it): the backend
  reads the earlier tokens' tail before the step writes any, so a sequence
  holds one slot at a time however its prompt is chunked.
* A copy-on-write copy gives its destination its own slot with the source's
  contents (``tail_copies``). A swap carries a tail with its block: the slot
  is copied to the host beside the block and freed, and the block swapped back
  in gets a new slot with those contents (``tail_swap_out`` / ``tail_swap_in``).
* The slots held are one pool for every live sequence: a request holds as
  many as one sequence uses at once (``tails_per_request``), so a block finds
  a free one. A slot given back while a block still uses it (another
  sequence's block took it from the shared pool) moves that tail to a free
  slot held (``tail_copies``), before anything reuses the slot's run
  (``core.block_moves.Phase``). Should none be free, a block simply gets none
  and its tokens read as int8, never an error.
* A hybrid KV layout (``core.kv_groups``) gives a sequence one table per
  group, and each group's layers their own metadata view: every rule above
  applies to each group's table and view. Slots stay keyed by physical block:
  a block serves one group at a time, so a slot (in every slot cache) holds
  the tail of that group's layers only. A sliding group's released entries
  (``NULL_BLOCK_ID``) lie behind its window, before the block its committed
  length ends in, so no kept range reaches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.block_moves import BlockMovePlan, CopyBlock, SwapIn, SwapOut, TailCopy, TailFill, TailIn, TailOut
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.logger import init_logger
from pagedllm.worker.input_batch import CachedSequence

logger = init_logger(__name__)


class StepTokens(NamedTuple):
    """The host side of a step's flattened tokens, as the tail plan reads them."""

    positions: np.ndarray  # each token's position in its sequence
    slot_mappings: np.ndarray  # [num_groups, num_tokens]: each token's pool slot in each group's blocks
    # Its prefill spans and tail fields (each group view's: ``group_views``) are
    # filled in by ``TailSlots.plan``.
    metadata: AttentionMetadata


class TailSlots:
    """``slot_of[block]``: the block's tail slot, -1 for none (``block_of`` the
    other way); the slots the scheduler's requests hold, and those no block uses."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slot_of = np.full(num_blocks, -1, dtype=np.int64)
        self.block_of: dict[int, int] = {}
        self.held: set[int] = set()
        self._free: list[int] = []
        self.num_refused = 0  # blocks that found no free slot (their tokens read as int8)
        self._host_tails: set[int] = set()  # host swap blocks whose tail went to the host with them

    @property
    def num_free(self) -> int:
        return len(self._free)

    def plan(self, scheduler_output: SchedulerOutput, sequences: Mapping[str, CachedSequence],
             block_tables: np.ndarray, tokens: StepTokens | None, device: torch.device) -> BlockMovePlan:
        """One step's decisions, by the module's rules: follow the block moves,
        release by committed state, give the blocks this step writes a slot,
        and put each token's tail write and each reader's slot in
        ``tokens.metadata`` and its group views (as tensors on ``device``;
        ``tokens`` is None for a step without tokens). ``sequences`` are the
        runner's live ones (each scheduled one's committed and written lengths
        are updated here) and ``block_tables`` ``[group, row, entry]`` their
        batch rows' tables. Returns the step's tail moves (their place in the
        step is ``core.block_moves.Phase``'s)."""
        block_moves = scheduler_output.block_moves
        self.update_held(scheduler_output.tails_taken, scheduler_output.tails_returned)
        moves = BlockMovePlan(TailOut(*move) for move in self.swap_out(block_moves.of(SwapOut)))
        copies = block_moves.of(CopyBlock)
        keep = self._committed_blocks(scheduler_output, sequences, block_tables)
        # Released before the copies and swap-ins take slots (the slots held are just
        # enough for the live sequences), but a copy's source only once it is read.
        self.release_all_but(np.concatenate([keep, np.array([src for src, _ in copies], dtype=np.int64)]))
        moves.add_all(TailCopy(*move) for move in self.copy(copies))
        moves.add_all(TailIn(*move) for move in self.swap_in(block_moves.of(SwapIn)))
        self.release_all_but(keep)
        moves.add_all(TailCopy(*move) for move in self.move_off_given_back())
        if tokens is not None:
            views = tokens.metadata.group_views or [tokens.metadata]
            moves.add_all(TailFill(*fill) for view, slots in zip(views, tokens.slot_mappings, strict=True)
                          for fill in self._place_writes(tokens.positions, slots, view, device))
        return moves

    def _committed_blocks(self, scheduler_output: SchedulerOutput, sequences: Mapping[str, CachedSequence],
                          block_tables: np.ndarray) -> np.ndarray:
        """The blocks whose slots stay: each sequence's, in every group's table, from
        its committed length's block to its last token written; for one scheduled
        now the committed length is exact, so only the block it ends in (when
        that is not full)."""
        block_size = self.block_size
        for scheduled in scheduler_output.scheduled:
            sequence = sequences[scheduled.sequence_id]
            sequence.num_computed = sequence.num_written = scheduled.num_computed_tokens
        keep = [block_tables[:, s.row, s.num_computed // block_size : min(-(-s.num_written // block_size),
                                                                          s.num_blocks)].ravel()
                for s in sequences.values()]
        for scheduled in scheduler_output.scheduled:
            sequences[scheduled.sequence_id].num_written += scheduled.num_scheduled_tokens
        return np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)

    def _place_writes(self, positions: np.ndarray, slots: np.ndarray, metadata: AttentionMetadata,
                      device: torch.device) -> list[tuple[int, int]]:
        """Give the blocks of one group that this step writes (its tokens'
        ``slots``) a slot, fill in that group's ``metadata`` tail writes and
        readers' slots; returns the new slots to fill."""
        block_size = self.block_size
        blocks, offsets = slots // block_size, positions % block_size
        # Each token's span end (context length after this step); decode rows are their own span.
        ends = positions + 1
        for span in metadata.prefills:
            ends[span.query_start : span.query_start + span.query_len] = span.context_len
        is_decode = np.arange(len(positions)) < metadata.num_decodes
        in_last_block = (positions // block_size == (ends - 1) // block_size) & (ends % block_size != 0)
        writes = (offsets != block_size - 1) & (is_decode | in_last_block)
        # A span that starts mid-block reads that block's tail; one that leaves it
        # for another partial block hands the slot on (read before written: the
        # backend reads a span's earlier tokens before this step's tail writes).
        for span in metadata.prefills:
            first_block = blocks[span.query_start]
            if (span.context_len - span.query_len) % block_size:
                span.tail_slot = int(self.slot_of[first_block])
            last_block = blocks[span.query_start + span.query_len - 1]
            if span.tail_slot >= 0 and last_block != first_block and span.context_len % block_size:
                self.hand_over(first_block, last_block)
        fills = self.ensure(blocks[writes])
        tail_of_token = self.slot_of[blocks]
        written = np.flatnonzero(writes & (tail_of_token >= 0))
        decodes = slice(0, metadata.num_decodes)
        metadata.tail_write_rows = _on(device, written)
        metadata.tail_write_slots = _on(device, tail_of_token[written] * block_size + offsets[written])
        metadata.decode_tail_slots = _on(device, np.where(offsets[decodes] != block_size - 1, tail_of_token[decodes], -1))
        return fills

    def update_held(self, taken: list[int], given_back: list[int]) -> None:
        """The slots the requests took and gave back since the last step (given back
        first: a slot may be given back and taken again). A slot given back that a
        block uses keeps it until ``move_off_given_back``."""
        for slot in given_back:
            self.held.discard(slot)
            if slot not in self.block_of:
                self._free.remove(slot)
        for slot in taken:
            self.held.add(slot)
            if slot not in self.block_of:
                self._free.append(slot)

    def move_off_given_back(self) -> list[tuple[int, int]]:
        """Move each tail still in a slot given back to a free slot held; returns the
        tail copies ``(old slot, new slot)`` (a tail that finds none is dropped)."""
        moves = []
        for slot, block in list(self.block_of.items()):
            if slot not in self.held:
                self.drop([block])
                if self._take(block):
                    moves.append((slot, int(self.slot_of[block])))
        return moves

    def drop(self, blocks: list[int]) -> None:
        """Release the slots of ``blocks`` (those that hold one)."""
        for block in blocks:
            slot = int(self.slot_of[block])
            if slot >= 0:
                self.slot_of[block] = -1
                del self.block_of[slot]
                if slot in self.held:
                    self._free.append(slot)

    def swap_out(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Swaps ``(device block, host block)`` -> ``(slot, host block)`` of the
        tails that go with them; their slots are freed."""
        moves = []
        for device, host in pairs:
            self._host_tails.discard(host)
            slot = int(self.slot_of[device])
            if slot >= 0:
                moves.append((slot, host))
                self._host_tails.add(host)
        self.drop([device for device, _ in pairs])
        return moves

    def swap_in(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Swaps ``(host block, device block)`` -> ``(host block, slot)``: each
        device block whose host block carried a tail gets a slot for it (its
        old, stale slot dropped)."""
        self.drop([device for _, device in pairs])
        moves = []
        for host, device in pairs:
            if host in self._host_tails:
                self._host_tails.discard(host)
                if self._take(device):
                    moves.append((host, int(self.slot_of[device])))
        return moves

    def copy(self, copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Block copies ``(src, dst)`` -> the tail copies ``(src slot, dst slot)``
        that give each destination the source's tail (a destination's old slot is
        dropped; one whose source has no tail gets none). Call before
        :meth:`release_all_but`: a copy's source may be released this step."""
        sources = [int(self.slot_of[src]) for src, _ in copies]
        self.drop([dst for _, dst in copies])
        moves = []
        for (_, dst), slot in zip(copies, sources):
            if slot >= 0 and self._take(dst):
                moves.append((slot, int(self.slot_of[dst])))
        return moves

    def release_all_but(self, keep: np.ndarray) -> None:
        """Release every slot whose block is not in ``keep`` (block ids)."""
        held = np.flatnonzero(self.slot_of >= 0)
        self.drop(held[~np.isin(held, keep)].tolist())

    def hand_over(self, src: int, dst: int) -> None:
        """Move ``src``'s slot to ``dst``, contents as they are (``dst``'s own slot,
        a stale one, is released): for a prefill span that leaves ``src`` full
        and writes every token of ``dst`` it will read, after reading ``src``'s tail."""
        self.drop([dst])
        slot = int(self.slot_of[src])
        self.slot_of[dst], self.slot_of[src] = slot, -1
        if slot >= 0:
            self.block_of[slot] = dst

    def ensure(self, blocks: np.ndarray) -> list[tuple[int, int]]:
        """Give each of ``blocks`` a slot if it has none; returns ``(block, slot)``
        of the new ones, to fill from the block's int8 values."""
        fills = []
        for block in np.unique(blocks).tolist():
            if self.slot_of[block] < 0 and self._take(block):
                fills.append((block, int(self.slot_of[block])))
        return fills

    def _take(self, block: int) -> bool:
        if not self._free:
            if not self.num_refused:
                logger.warning("int8 KV: a still-filling block found no free full-precision tail slot among the "
                               "%d the requests hold; blocks without one read as int8", len(self.held))
            self.num_refused += 1
            return False
        slot = self._free.pop()
        self.slot_of[block] = slot
        self.block_of[slot] = block
        return True


def _on(device: torch.device, array: np.ndarray) -> torch.Tensor:
    """A fresh host array on the device (shared, not copied, on the CPU: no later step writes it)."""
    return torch.from_numpy(array).to(device)

"""Which physical block's full-precision tail is in which tail slot (int8 pools).

The readers' rule is in ``pagedllm.attention.kv_cache`` ("Full-precision
tails"): a query reads its own block at full precision unless it sits at the
block's last position. This module decides, on the driver, which blocks hold a
tail slot; the runner turns that into the step's tail writes and moves.

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
* When every slot is taken (more live sequences than the pool was planned
  for) a block simply gets none and its tokens read as int8, never an error.
"""

from __future__ import annotations

import numpy as np

from pagedllm.logger import init_logger

logger = init_logger(__name__)


class TailSlots:
    """``slot_of[block]``: the block's tail slot, -1 for none; and the free slots."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a tail pool needs at least one slot, got {num_slots}")
        self.slot_of = np.full(num_blocks, -1, dtype=np.int64)
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: low slots first
        self.num_refused = 0  # blocks that found no free slot (their tokens read as int8)
        self._host_tails: set[int] = set()  # host swap blocks whose tail went to the host with them

    @property
    def num_free(self) -> int:
        return len(self._free)

    def drop(self, blocks: list[int]) -> None:
        """Release the slots of ``blocks`` (those that hold one)."""
        for block in blocks:
            slot = int(self.slot_of[block])
            if slot >= 0:
                self._free.append(slot)
                self.slot_of[block] = -1

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
        self.slot_of[dst], self.slot_of[src] = self.slot_of[src], -1

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
                logger.warning("int8 KV: all %d full-precision tail slots are in use; partial blocks without "
                               "one read as int8 (size the pool for more sequences: max_num_seqs)", self.num_slots)
            self.num_refused += 1
            return False
        self.slot_of[block] = self._free.pop()
        return True

"""The tail slot bookkeeping of int8 pools (``pagedllm.worker.tail_slots``)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.block_moves import TailFill
from pagedllm.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedSequence
from pagedllm.worker.tail_slots import StepTokens, TailSlots


def holding(num_blocks: int, num_slots: int, block_size: int) -> TailSlots:
    """Tail bookkeeping whose requests hold slots ``0 .. num_slots - 1`` (handed out low first)."""
    tails = TailSlots(num_blocks, block_size)
    tails.update_held(list(range(num_slots - 1, -1, -1)), [])
    return tails


def test_ensure_assigns_once_and_reports_the_new_slots_to_fill():
    tails = holding(num_blocks=8, num_slots=3, block_size=4)
    assert tails.ensure(np.array([5, 2, 5])) == [(2, 0), (5, 1)]
    assert tails.ensure(np.array([2, 7])) == [(7, 2)]  # 2 already has its slot: no refill
    assert tails.num_free == 0


def test_release_keeps_only_the_blocks_asked_for():
    tails = holding(8, 3, 4)
    tails.ensure(np.array([1, 2, 3]))
    tails.release_all_but(np.array([2, 6]))
    assert tails.slot_of[1] == -1 and tails.slot_of[3] == -1 and tails.slot_of[2] == 1
    assert tails.num_free == 2


def test_copies_give_each_destination_its_own_slot_and_read_sources_first():
    tails = holding(8, 4, 4)
    tails.ensure(np.array([1, 4]))  # 1 -> slot 0, 4 -> slot 1
    # 4 is copied to 6, and 1 is copied onto 4 in the same step: 6 gets 4's old tail.
    moves = tails.copy([(4, 6), (1, 4), (3, 5)])  # 3 has no tail: 5 gets none
    assert moves == [(1, int(tails.slot_of[6])), (0, int(tails.slot_of[4]))]
    assert len({int(tails.slot_of[b]) for b in (1, 4, 6)}) == 3 and tails.slot_of[5] == -1


def test_exhaustion_leaves_blocks_without_a_tail_and_counts_them():
    tails = holding(8, 1, 4)
    assert tails.ensure(np.array([0, 1])) == [(0, 0)]
    assert tails.slot_of[1] == -1 and tails.num_refused == 1


def test_a_slot_given_back_leaves_the_free_ones_and_its_tail_moves_to_a_held_one():
    tails = holding(8, 3, 4)
    tails.ensure(np.array([3]))  # 3 -> slot 0, which another request gave back (its block still uses it)
    tails.update_held([], [0, 2])  # slot 2 was free: it goes at once
    assert tails.num_free == 1 and tails.slot_of[3] == 0
    assert tails.move_off_given_back() == [(0, 1)]
    assert tails.slot_of[3] == 1 and tails.num_free == 0 and tails.block_of == {1: 3}
    tails.update_held([0], [])
    assert tails.ensure(np.array([6])) == [(6, 0)]


def test_a_slot_given_back_and_taken_again_stays_with_its_block():
    tails = holding(8, 1, 4)
    tails.ensure(np.array([3]))
    tails.update_held([0], [0])
    assert tails.move_off_given_back() == [] and tails.slot_of[3] == 0 and tails.num_free == 0


def test_hand_over_moves_the_slot_and_releases_a_stale_one():
    tails = holding(8, 3, 4)
    tails.ensure(np.array([1, 5]))  # 1 -> 0, 5 -> 1 (stale)
    tails.hand_over(1, 5)
    assert tails.slot_of[5] == 0 and tails.slot_of[1] == -1 and tails.num_free == 2


def test_a_swapped_tail_comes_back_to_the_block_swapped_in():
    tails = holding(8, 2, 4)
    tails.ensure(np.array([3]))  # 3 -> slot 0
    assert tails.swap_out([(3, 10), (4, 11)]) == [(0, 10)]  # 4 has no tail
    assert tails.num_free == 2
    tails.ensure(np.array([6]))  # 6 takes slot 0 meanwhile
    assert tails.swap_in([(11, 2), (10, 5)]) == [(10, int(tails.slot_of[5]))]
    assert tails.slot_of[5] == 1 and tails.slot_of[2] == -1
    assert tails.swap_in([(10, 7)]) == []  # a host tail comes back once


def test_plan_keeps_the_committed_block_and_gives_a_decode_its_tail():
    """A step planned from plain data (no runner): the sequence's committed
    5 tokens end in block 5 (block size 4), so block 3's stale slot goes, and
    the decode at position 5 writes offset 1 of block 5's new tail and reads it."""
    tails = holding(num_blocks=8, num_slots=2, block_size=4)
    tails.ensure(np.array([3]))
    sequence = CachedSequence(NewSequenceData("a", [1, 2, 3, 4, 5], [], [[3, 5]], SamplingParams()), row=0)
    sequence.num_blocks = 2
    metadata = AttentionMetadata(slot_mapping=torch.tensor([21]), num_decodes=1,
                                 decode_block_tables=torch.tensor([[3, 5]]), decode_context_lens=torch.tensor([6]),
                                 prefills=[])
    step = SchedulerOutput(scheduled=[ScheduledSequence("a", num_computed_tokens=5, num_scheduled_tokens=1)])
    moves = tails.plan(step, {"a": sequence}, np.array([[[3, 5]]]),
                       StepTokens(np.array([5]), np.array([[21]]), metadata), torch.device("cpu"))
    slot = int(tails.slot_of[5])
    assert tails.slot_of[3] == -1 and moves.of(TailFill) == [(5, slot)] and tails.num_free == 1
    assert metadata.tail_write_rows.tolist() == [0] and metadata.tail_write_slots.tolist() == [slot * 4 + 1]
    assert metadata.decode_tail_slots.tolist() == [slot]
    assert (sequence.num_computed, sequence.num_written) == (5, 6)


def test_plan_gives_each_group_its_own_tail_and_view():
    """Two KV cache groups (hybrid layout): the sequence's committed 5 tokens end
    in block 5 of the full group and block 6 of the sliding one, whose entry 0 the
    window released (``NULL_BLOCK_ID``, 0). Each group's block gets its own slot,
    each group's view its own tail writes and reads; block 0's slot (another
    sequence's, gone) is released, not kept by the released entry."""
    tails = holding(num_blocks=8, num_slots=3, block_size=4)
    tails.ensure(np.array([0]))
    sequence = CachedSequence(NewSequenceData("a", [1, 2, 3, 4, 5], [], [[3, 5], [0, 6]], SamplingParams()), row=0)
    sequence.num_blocks = 2
    views = [AttentionMetadata(slot_mapping=torch.tensor([slot]), num_decodes=1,
                               decode_block_tables=torch.tensor([table]), decode_context_lens=torch.tensor([6]),
                               prefills=[])
             for slot, table in ((21, [3, 5]), (25, [0, 6]))]
    views[0].group_views = views
    step = SchedulerOutput(scheduled=[ScheduledSequence("a", num_computed_tokens=5, num_scheduled_tokens=1)])
    moves = tails.plan(step, {"a": sequence}, np.array([[[3, 5]], [[0, 6]]]),
                       StepTokens(np.array([5]), np.array([[21], [25]]), views[0]), torch.device("cpu"))
    slots = [int(tails.slot_of[5]), int(tails.slot_of[6])]
    assert tails.slot_of[0] == -1 and sorted(moves.of(TailFill)) == [(5, slots[0]), (6, slots[1])]
    assert slots[0] != slots[1] and tails.num_free == 1
    for view, slot in zip(views, slots):
        assert view.tail_write_rows.tolist() == [0] and view.tail_write_slots.tolist() == [slot * 4 + 1]
        assert view.decode_tail_slots.tolist() == [slot]

"""The block move plan: one order, stated by ``Phase``, whatever order moves are added in."""

from __future__ import annotations

import pickle

from pagedllm.core.block_moves import (BlockMovePlan, CopyBlock, Phase, SwapIn, SwapOut, TailFill, TierDrop,
                                       TierLoad, TierOffload, TierPersist)


def test_phases_come_in_phase_order_and_moves_in_the_order_added():
    plan = BlockMovePlan([TierPersist(4, b"p"), TierLoad(b"k", 3), SwapIn(0, 3), CopyBlock(1, 2), SwapOut(3, 0),
                          TierDrop(b"k"), TierOffload(3, b"o"), CopyBlock(5, 6), TailFill(2, 0)])
    before = [(phase, list(moves)) for phase, moves in plan.phases(before=Phase.FORWARD)]
    assert before == [
        (Phase.TIER_OFFLOAD, [TierOffload(3, b"o")]),
        (Phase.SWAP_OUT, [SwapOut(3, 0)]),
        (Phase.COPY, [CopyBlock(1, 2), CopyBlock(5, 6)]),
        (Phase.SWAP_IN, [SwapIn(0, 3)]),
        (Phase.TIER_LOAD, [TierLoad(b"k", 3)]),
        (Phase.TIER_DROP, [TierDrop(b"k")]),
        (Phase.TAIL_FILL, [TailFill(2, 0)]),
    ]
    assert list(plan.phases(after=Phase.FORWARD)) == [(Phase.TIER_PERSIST, [TierPersist(4, b"p")])]
    assert len(plan) == 9 and plan.of(CopyBlock) == [(1, 2), (5, 6)]


def test_an_empty_plan_is_falsy_and_survives_pickling():
    empty = BlockMovePlan()
    assert not empty and len(empty) == 0 and list(empty.phases()) == [] and empty.of(SwapOut) == []
    restored = pickle.loads(pickle.dumps(empty))
    assert restored == empty and not restored
    plan = BlockMovePlan([SwapOut(1, 2), TierLoad(b"\x00" * 32, 7)])
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_extend_appends_per_phase_and_copy_does_not_alias():
    plan = BlockMovePlan([CopyBlock(1, 2)])
    later = BlockMovePlan([CopyBlock(3, 4), SwapOut(5, 0)])
    copy = plan.copy()
    plan.extend(later)
    assert plan.of(CopyBlock) == [(1, 2), (3, 4)] and plan.of(SwapOut) == [(5, 0)]
    assert copy.of(CopyBlock) == [(1, 2)] and not copy.of(SwapOut)
    assert later.of(CopyBlock) == [(3, 4)]  # extend copied the other plan's moves, it did not take its lists

"""An int8 pool's full-precision tails as owned runs of the shared pool
(``core/kv_managers/tail_runs.py``): taken as a request starts writing, given
back with its device blocks, reported to the runner in order."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_managers.tail_runs import TailRun, tails_per_request
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def manager(num_blocks: int = 16, **options) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, tail_run_blocks=4, tails_per_request=1, **options)


def request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(), [0], max_tokens=8)


def test_one_tail_per_group_and_per_block_a_draft_reaches_past():
    assert tails_per_request(1, 16, 0) == 1
    assert tails_per_request(3, 16, 4) == 6
    assert tails_per_request(2, 4, 5) == 6


def test_an_aligned_run_skips_a_run_that_straddles_the_alignment():
    pool = BlockPool(10)
    held = pool.get_new_blocks(2)  # blocks 0 and 1
    pool.free_blocks([held[0]])
    owner = TailRun("a")
    assert [b.block_id for b in pool.take_run(4, owner, align=4)] == [4, 5, 6, 7]
    assert pool.take_run(4, TailRun("b"), align=4) is None  # 0-3 holds block 1, 8-11 is past the pool
    assert pool.take_run(2, TailRun("c"), align=2)[0].block_id == 8


def test_a_run_avoids_the_blocks_asked_for():
    """A new request's tails never take (and so evict) a block of its own prefix hit."""
    assert [b.block_id for b in BlockPool(8).take_run(4, TailRun("a"), align=4, avoid={5})] == [0, 1, 2, 3]
    assert BlockPool(8).take_run(4, TailRun("a"), align=4, avoid={1, 5}) is None


def test_admission_takes_the_tails_and_free_gives_them_back_in_order():
    kv = manager()
    assert kv.admit(request("a", 6), lambda num_cached: 6 - num_cached) is not None
    assert kv.num_free_blocks == 16 - 2 - 4
    [run] = kv.tails.held["a"]
    slot = run.blocks[0].block_id // 4
    assert kv.take_tail_changes() == ([slot], [])
    assert all(block["tail"] and block["owners"] == ["a"] for block in kv.pool_snapshot()[slot * 4: slot * 4 + 4])
    kv.free("a")
    kv.check_invariants({}, ())
    assert kv.num_free_blocks == 16 and kv.take_tail_changes() == ([], [slot])


def test_tails_taken_and_given_back_before_the_runner_hears_are_never_reported():
    kv = manager()
    kv.admit(request("a", 6), lambda num_cached: 6 - num_cached)
    kv.free("a")
    assert kv.take_tail_changes() == ([], [])


def test_a_request_that_cannot_get_its_tails_waits_with_nothing_taken():
    kv = manager(num_blocks=8)
    assert kv.admit(request("a", 6), lambda num_cached: 6 - num_cached) is not None
    # 8 blocks: a's tail (4) and blocks (2) leave 2, no aligned run of 4.
    assert kv.admit(request("b", 2), lambda num_cached: 2 - num_cached) is None
    assert "b" not in kv.tails.held and kv.num_free_blocks == 2


def test_a_forks_child_takes_its_tails_when_it_first_writes_and_swap_out_gives_them_back():
    kv = manager(num_swap_blocks=8)
    kv.admit(request("a", 6), lambda num_cached: 6 - num_cached)
    assert kv.fork("a", "b") == []
    assert "b" not in kv.tails.held
    kv.check_invariants({"a": 6, "b": 6}, ())
    assert kv.allocate_slots("b", 6, 1) is not None and "b" in kv.tails.held
    kv.take_tail_changes()
    [run] = kv.tails.held["b"]
    assert kv.swap_out("b") is not None and "b" not in kv.tails.held
    assert kv.take_tail_changes() == ([], [run.blocks[0].block_id // 4])
    swapped = request("b", 7)
    swapped.num_computed_tokens = 6
    assert kv.admit_swapped(swapped, 1) is not None and "b" in kv.tails.held
    kv.check_invariants({"a": 6, "b": 7}, ())


def test_the_admission_check_counts_the_tails():
    kv = manager()
    assert kv.num_blocks_to_start(5) == 2 + 4

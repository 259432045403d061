"""Block pool and block tables: counts, order, all-or-nothing allocation, no leaks."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager


def test_free_queue_pops_oldest_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 0]
    assert len(queue) == 4
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])


def test_pool_allocation_is_all_or_nothing_and_counts_references():
    pool = BlockPool(4)
    taken = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in taken] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # the failed call took nothing
    pool.free_blocks(taken)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([taken[0]])
    pool.check_invariants()


def test_manager_takes_a_block_only_when_the_last_one_fills():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate_slots("a", 0, 3) == []
    assert len(kv.get_block_ids("a")[0]) == 1
    kv.allocate_slots("a", 3, 1)  # still fits in block 0
    assert len(kv.get_block_ids("a")[0]) == 1
    kv.allocate_slots("a", 4, 1)
    assert len(kv.get_block_ids("a")[0]) == 2
    assert kv.num_free_blocks == 8


def test_manager_returns_none_and_changes_nothing_on_shortfall():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 0, 8)
    before = kv.get_block_ids("a")[0]
    assert kv.allocate_slots("b", 0, 8) is None
    assert "b" not in kv.groups[0].tables
    assert kv.allocate_slots("a", 8, 8) is None
    assert kv.get_block_ids("a")[0] == before
    assert kv.num_free_blocks == 1
    kv.check_invariants({"a": 8}, swapped=())


def test_free_is_tail_first_and_uncached_blocks_are_reused_first():
    """A finished request's cached blocks join the LRU tail-first, so its prefix is
    evicted last; a block that never got a hash goes to the front (reused first)."""
    from pagedllm.core.request import Request
    from pagedllm.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=5, block_size=2)
    request = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(), [0], max_tokens=1)
    kv.allocate_slots("a", 0, 7)
    request.num_computed_tokens = 7
    kv.cache_full_blocks(request, 7)  # 3 full blocks hashed, the 4th (1 token) not
    ids = kv.get_block_ids("a")[0]
    kv.free("a")
    free_order = [b.block_id for b in kv.block_pool.free_block_queue]
    assert free_order[0] == ids[3]  # the unhashed tail: reused first
    assert free_order[-3:] == [ids[2], ids[1], ids[0]]  # the prefix block is evicted last
    kv.free("a")  # freeing twice is a no-op, not a double free
    assert kv.num_free_blocks == 5


def test_block_size_must_be_a_power_of_two():
    for bad in (0, 3, 12, 512):
        with pytest.raises(ValueError, match="power of two"):
            KVCacheManager(num_blocks=4, block_size=bad)


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 24), operations=ops)
def test_random_operations_keep_every_invariant(block_size, num_blocks, operations):
    kv = KVCacheManager(num_blocks, block_size)
    tokens: dict[str, int] = {}
    for op, req, amount in operations:
        rid = f"r{req}"
        if op == "grow":
            target = tokens.get(rid, 0) + amount
            free_before = kv.num_free_blocks
            table_before = kv.get_block_ids(rid)[0]
            result = kv.allocate_slots(rid, tokens.get(rid, 0), amount)
            if result is None:
                # All-or-nothing: a refusal changes nothing.
                assert kv.num_free_blocks == free_before
                assert kv.get_block_ids(rid)[0] == table_before
                assert math.ceil(target / block_size) - len(table_before) > free_before
            else:
                tokens[rid] = target
                # Append-only table, exactly ceil(tokens / block_size) long.
                assert kv.get_block_ids(rid)[0][: len(table_before)] == table_before
                assert len(kv.get_block_ids(rid)[0]) == math.ceil(target / block_size)
        else:
            kv.free(rid)
            tokens.pop(rid, None)
        kv.check_invariants(tokens, swapped=())
        assert kv.num_free_blocks + sum(len(kv.get_block_ids(r)[0]) for r in tokens) == num_blocks
    for rid in list(tokens):
        kv.free(rid)
    assert kv.num_free_blocks == num_blocks
    kv.check_invariants({}, swapped=())

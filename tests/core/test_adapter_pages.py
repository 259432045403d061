"""Unified paging bookkeeping: runs of blocks for adapters, pins, LRU eviction beside cached blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.adapter_pages import AdapterPager
from pagedllm.core.adapter_spec import AdapterSpec
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def _request(name: str | None, pages: int = 3, request_id: str = "r") -> Request:
    lora = None if name is None else AdapterSpec(name, f"/adapters/{name}", pages)
    return Request(request_id, [1, 2, 3], SamplingParams(), eos_token_ids=[0], max_tokens=4, lora=lora)


def test_take_run_prefers_plain_free_blocks_at_the_top():
    pool = BlockPool(10)
    pool.cache_block(pool.get_new_blocks(1)[0], b"h0")  # block 0, cached below
    pool.free_blocks([pool.blocks[0]])
    run = pool.take_run(4)
    assert [b.block_id for b in run] == [6, 7, 8, 9]
    assert all(b.ref_cnt == 1 for b in run) and pool.num_free_blocks == 6
    pool.check_invariants()


def test_take_run_evicts_cached_blocks_only_when_it_must():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for index, block in enumerate(blocks):
        pool.cache_block(block, bytes([index]))
    pool.free_blocks(blocks)
    run = pool.take_run(3)
    assert [b.block_id for b in run] == [1, 2, 3]
    assert pool.num_cached_blocks == 1 and pool.num_evictions == 3
    assert pool.take_run(2) is None  # only block 0 is free
    pool.check_invariants()


def test_pinned_adapters_are_kept_and_idle_ones_revive_without_a_page_in():
    pool = BlockPool(12)
    pager = AdapterPager(pool)
    first, second = _request("sql"), _request("sql", request_id="s")
    assert pager.pin_for(first) and pager.pin_for(second)
    assert [load.name for load in pager.take_loads()] == ["sql"] and pager.num_page_ins == 1
    assert pool.num_free_blocks == 9
    pager.unpin_for(first)
    assert pool.num_free_blocks == 9  # still pinned by the second
    pager.unpin_for(second)
    assert pool.num_free_blocks == 12 and "sql" in pager.resident  # idle, resident
    assert pager.pin_for(_request("sql"))
    assert pager.take_loads() == [] and pager.num_page_ins == 1
    pager.check_invariants()
    pool.check_invariants()


def test_an_idle_adapter_is_evicted_lru_beside_cached_blocks():
    pool = BlockPool(6)
    pager = AdapterPager(pool)
    request = _request("sql", pages=3)
    pager.pin_for(request)
    pager.unpin_for(request)
    taken = pool.get_new_blocks(4)  # three plain free blocks first, then an adapter page
    assert "sql" not in pager.resident
    assert all(block.owner is None for block in pool.blocks)
    pool.free_blocks(taken)
    assert pager.pin_for(request) and pager.num_page_ins == 2
    pager.check_invariants()


def test_a_request_waits_when_no_run_fits_or_max_loras_is_reached():
    pool = BlockPool(8)
    pager = AdapterPager(pool, max_loras=1)
    pool.get_new_blocks(1)  # block 0 in use by some request
    held = pool.take_run(1)  # and one in the middle
    assert not pager.pin_for(_request("big", pages=7))  # 6 free blocks, none 7 in a row
    assert pager.pin_for(_request("a", pages=2))
    assert not pager.pin_for(_request("b", pages=1))  # max_loras
    pool.free_blocks(held)
    pager.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin", "alloc", "free"]), st.integers(0, 3)), max_size=40))
def test_random_pins_and_allocations_keep_every_invariant(ops):
    pool = BlockPool(16)
    pager = AdapterPager(pool, max_loras=3)
    pinned: list[Request] = []
    allocated = []
    for op, arg in ops:
        if op == "pin":
            request = _request(f"a{arg}", pages=arg + 2, request_id=str(len(pinned)))
            if pager.pin_for(request):
                pinned.append(request)
        elif op == "unpin" and pinned:
            pager.unpin_for(pinned.pop(arg % len(pinned)))
        elif op == "alloc" and pool.num_free_blocks >= arg + 1:
            blocks = pool.get_new_blocks(arg + 1)
            if arg % 2:
                pool.cache_block(blocks[0], bytes([len(allocated)]))
            allocated.append(blocks)
        elif op == "free" and allocated:
            pool.free_blocks(allocated.pop(arg % len(allocated)))
        pager.check_invariants()
        pool.check_invariants()
        pinned_pages = sum(len(r.pages) for r in pager.resident.values() if r.pins)
        assert pool.num_free_blocks == 16 - pinned_pages - sum(map(len, allocated))

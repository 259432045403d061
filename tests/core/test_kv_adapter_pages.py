"""Unified paging bookkeeping: runs of blocks for adapters, pins, LRU eviction beside
cached blocks (``core/kv_managers/adapter_pages.py``), on its own and under the coordinator."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.adapter_spec import AdapterSpec
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_managers.adapter_pages import AdapterPages


def _spec(name: str, pages: int = 3) -> AdapterSpec:
    return AdapterSpec(name, f"/adapters/{name}", pages)


class _Holder:
    """A block owner for the pool's own tests: counts its evictions."""

    name = "holder"

    def __init__(self) -> None:
        self.evictions = 0

    def evicted(self, block: KVCacheBlock) -> None:
        self.evictions += 1


def test_take_run_prefers_plain_free_blocks_at_the_top_and_owns_them_at_once():
    pool = BlockPool(10)
    pool.cache_block(pool.get_new_blocks(1)[0], b"h0")  # block 0, cached below
    pool.free_blocks([pool.blocks[0]])
    holder = _Holder()
    run = pool.take_run(4, holder)
    assert [b.block_id for b in run] == [6, 7, 8, 9]
    assert all(b.ref_cnt == 1 and b.owner is holder for b in run) and pool.num_free_blocks == 6
    pool.check_invariants()


def test_take_run_evicts_cached_blocks_only_when_it_must():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for index, block in enumerate(blocks):
        pool.cache_block(block, bytes([index]))
    pool.free_blocks(blocks)
    run = pool.take_run(3, _Holder())
    assert [b.block_id for b in run] == [1, 2, 3]
    assert pool.num_cached_blocks == 1 and pool.num_evictions == 3
    assert pool.take_run(2, _Holder()) is None  # only block 0 is free
    pool.check_invariants()


def test_pinned_adapters_are_kept_and_idle_ones_revive_without_a_page_in():
    pool = BlockPool(12)
    pages = AdapterPages(pool)
    assert pages.pin("r", _spec("sql")) and pages.pin("s", _spec("sql"))
    assert [load.name for load in pages.take_loads()] == ["sql"] and pages.num_page_ins == 1
    assert pool.num_free_blocks == 9
    pages.unpin("r")
    assert pool.num_free_blocks == 9  # still pinned by the second
    pages.unpin("s")
    pages.unpin("s")  # a request that holds no pin: a no-op
    assert pool.num_free_blocks == 12 and "sql" in pages.resident  # idle, resident
    assert pages.pin("t", _spec("sql"))
    assert pages.take_loads() == [] and pages.num_page_ins == 1
    pages.check_invariants({"t"})
    pool.check_invariants()


def test_an_idle_adapter_is_evicted_lru_beside_cached_blocks():
    pool = BlockPool(6)
    pages = AdapterPages(pool)
    pages.pin("r", _spec("sql"))
    pages.unpin("r")
    taken = pool.get_new_blocks(4)  # three plain free blocks first, then an adapter page
    assert "sql" not in pages.resident
    assert all(block.owner is None for block in pool.blocks)
    pool.free_blocks(taken)
    assert pages.pin("r", _spec("sql")) and pages.num_page_ins == 2
    pages.check_invariants({"r"})


def test_a_request_waits_when_no_run_fits_or_max_loras_is_reached():
    pool = BlockPool(8)
    pages = AdapterPages(pool, max_loras=1)
    pool.get_new_blocks(1)  # block 0 in use by some request
    held = pool.take_run(1, _Holder())  # and one in the middle
    assert not pages.pin("r", _spec("big", pages=7))  # 6 free blocks, none 7 in a row
    assert pages.pin("s", _spec("a", pages=2))
    assert not pages.pin("t", _spec("b", pages=1))  # max_loras
    assert pages.pinned_by.keys() == {"s"}
    pool.free_blocks(held)
    pages.check_invariants({"s"})


def test_without_lora_a_request_under_an_adapter_is_refused():
    pages = AdapterPages(BlockPool(4), enabled=False)
    assert pages.pin("r", None)
    try:
        pages.pin("s", _spec("sql"))
    except ValueError as error:
        assert "enable_lora" in str(error)
    else:
        raise AssertionError("a disabled adapter kind pinned an adapter")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin", "alloc", "free"]), st.integers(0, 3)), max_size=40))
def test_random_pins_and_allocations_keep_every_invariant(ops):
    pool = BlockPool(16)
    pages = AdapterPages(pool, max_loras=3)
    pinned: list[str] = []
    allocated = []
    for step, (op, arg) in enumerate(ops):
        if op == "pin":
            if pages.pin(str(step), _spec(f"a{arg}", pages=arg + 2)):
                pinned.append(str(step))
        elif op == "unpin" and pinned:
            pages.unpin(pinned.pop(arg % len(pinned)))
        elif op == "alloc" and pool.num_free_blocks >= arg + 1:
            blocks = pool.get_new_blocks(arg + 1)
            if arg % 2:
                pool.cache_block(blocks[0], bytes([len(allocated)]))
            allocated.append(blocks)
        elif op == "free" and allocated:
            pool.free_blocks(allocated.pop(arg % len(allocated)))
        pages.check_invariants(set(pinned))
        pool.check_invariants()
        pinned_pages = sum(len(r.pages) for r in pages.resident.values() if r.pins)
        assert pool.num_free_blocks == 16 - pinned_pages - sum(map(len, allocated))

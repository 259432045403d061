"""The free queue is the LRU of cached blocks: least recently freed evicted first,
referenced blocks never."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 2


def admit(kv: KVCacheManager, rid: str, prompt: list[int]) -> Request | None:
    """Admit with prefix-cache lookup, compute the whole prompt, register its full blocks."""
    request = Request(rid, prompt, SamplingParams(), [0], max_tokens=1)
    hits, num_cached, _ = kv.get_computed_blocks(request)
    if kv.allocate_slots(rid, num_cached, len(prompt) - num_cached, hits) is None:
        return None
    request.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(request, len(prompt))
    return request


def test_least_recently_freed_cached_blocks_are_evicted_first():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    for rid, first in (("a", 10), ("b", 20), ("c", 30)):
        admit(kv, rid, [first, first + 1, first + 2, first + 3])  # 2 full blocks each
    tables = {rid: kv.get_block_ids(rid)[0] for rid in "abc"}
    for rid in ("b", "a", "c"):
        kv.free(rid)
    assert kv.block_pool.num_cached_blocks == 6
    # Tail-first within a request, requests in the order freed.
    order = [b.block_id for b in kv.block_pool.free_block_queue]
    assert order == tables["b"][::-1] + tables["a"][::-1] + tables["c"][::-1]
    admit(kv, "d", [1, 2, 3, 4, 5])  # needs 3 fresh blocks: evicts b's two, then a's tail
    assert set(kv.get_block_ids("d")[0]) == set(tables["b"]) | {tables["a"][1]}
    assert kv.block_pool.num_cached_blocks == 3 + 2  # a's head, c's two, and d's two full blocks
    # a's surviving head block is found again.
    hits, _, _ = kv.get_computed_blocks(Request("e", [10, 11, 99, 98, 97], SamplingParams(), [0], 1))
    assert [[b.block_id for b in group_hits] for group_hits in hits] == [[tables["a"][0]]]


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=9)  # tiny alphabet: many shared prefixes


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), prompts), max_size=40), num_blocks=st.integers(3, 12))
def test_random_workloads_never_evict_referenced_blocks_and_keep_lru_order(ops, num_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    ids = itertools.count()
    live: dict[str, Request] = {}
    freed_at: dict[int, int] = {}  # block id -> when it last reached ref_cnt 0
    clock = itertools.count()
    for is_admit, prompt in ops:
        if is_admit or not live:
            rid = f"r{next(ids)}"
            hashes_before = {b.block_id: b.block_hash for b in kv.block_pool.blocks if b.ref_cnt > 0}
            request = admit(kv, rid, prompt)
            if request is not None:
                live[rid] = request
            # A referenced block never loses its hash to eviction.
            for block_id, block_hash in hashes_before.items():
                assert kv.block_pool.blocks[block_id].block_hash == block_hash
        else:
            rid = sorted(live)[len(prompt) % len(live)]
            table = [kv.block_pool.blocks[b] for b in kv.get_block_ids(rid)[0]]
            kv.free(rid)
            del live[rid]
            for block in reversed(table):
                if block.ref_cnt == 0:
                    freed_at[block.block_id] = next(clock)
        kv.check_invariants({rid: r.num_tokens for rid, r in live.items()}, swapped=())
        cached_free = [b.block_id for b in kv.block_pool.free_block_queue if b.block_hash is not None]
        times = [freed_at[b] for b in cached_free]
        assert times == sorted(times)  # LRU order: least recently freed at the front
        uncached_free = [b.block_hash is None for b in kv.block_pool.free_block_queue]
        assert uncached_free == sorted(uncached_free, reverse=True)  # uncached blocks come first
    for rid in live:
        kv.free(rid)
    kv.reset_prefix_cache()
    assert kv.num_free_blocks == num_blocks and kv.block_pool.num_cached_blocks == 0

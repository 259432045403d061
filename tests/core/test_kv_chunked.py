"""Chunked local attention groups (Llama 4's local layers) beside full and sliding ones:
with chunk C a query at p reads keys from floor(p / C) * C, so blocks wholly before
the current chunk are released, a hit needs the blocks from its chunk's start, and the
coordinator fuzz runs with chunked groups (chunk 6 over blocks of 4: chunk starts fall
mid-block) with the invariant checker on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import KVGroupSpec, kv_group_layout
from pagedllm.core.kv_interface import NULL_BLOCK_ID
from pagedllm.core.kv_managers.chunked_local import ChunkedLocal
from tests.core.test_kv_coordinator import BLOCK_SIZE, CoordinatorMachine, TieredCoordinatorMachine, request
from tests.core.test_kv_groups import assert_admissions_bound_holds

CHUNK = 6
WINDOW = 8
# Llama-4-like: two chunked layers, then a full one; plus two sliding layers.
LAYOUT = kv_group_layout([ChunkedLocal(CHUNK), ChunkedLocal(CHUNK), None, WINDOW, WINDOW, None])


def manager(num_blocks: int = 64, **options) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, windows=LAYOUT.kinds, **options)


def test_chunked_layers_group_after_full_and_sliding_ones_and_describe_their_chunk():
    assert [(group.kind, group.window, group.chunk, group.layers) for group in LAYOUT.groups] == [
        ("full", None, None, (2, 5)), ("sliding_window", 8, None, (3, 4)), ("chunked_local", None, 6, (0, 1))]
    assert LAYOUT.groups[2].describe() == "chunked local attention 6, layers 0,1"
    assert "group 2 chunked local attention, for their chunk of 6 tokens (layers 0-1)" in LAYOUT.describe(4)
    assert kv_group_layout([ChunkedLocal(8), None], hybrid=False).groups == (KVGroupSpec("full", (0, 1)),)
    assert kv_group_layout([ChunkedLocal(8)] * 2, hybrid=False).groups == (KVGroupSpec("chunked_local", (0, 1),
                                                                                       chunk=8),)
    with pytest.raises(ValueError, match="chunk"):
        KVGroupSpec("chunked_local", (0,))
    with pytest.raises(ValueError, match="chunk"):
        kv_group_layout([ChunkedLocal(0)])


@pytest.mark.parametrize("num_tokens, released", [(0, 0), (5, 0), (6, 1), (11, 1), (12, 3), (17, 3), (18, 4),
                                                  (24, 6)])
def test_a_chunked_group_releases_the_blocks_wholly_before_the_chunk(num_tokens, released):
    """Chunk 6, blocks of 4: at 12 the chunk starts at 12 (blocks 0-2 behind), at 17 still at 12."""
    assert ChunkedLocal(CHUNK).num_released(num_tokens, BLOCK_SIZE) == released


def test_the_manager_releases_behind_each_chunk_while_group_0_keeps_every_block():
    kv = manager()
    kv.allocate_slots("a", 0, 3)
    for position in range(3, 60):
        assert kv.allocate_slots("a", position, 1) == []
        assert kv.allocate_slots("a", position + 1, 0) == []
        chunked = (position + 1) // CHUNK * CHUNK // BLOCK_SIZE
        assert kv.num_released("a")[2] == chunked
        assert kv.get_block_ids("a")[2][:chunked] == [NULL_BLOCK_ID] * chunked
        assert kv.num_blocks_in_use == LAYOUT.blocks_held(position + 1, BLOCK_SIZE)
        kv.check_invariants({"a": position + 1}, swapped=())
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks


def test_a_prefix_that_outgrew_the_chunk_hits_and_needs_the_blocks_from_the_chunk_start():
    kv = manager()
    prompt = list(range(100, 140))  # 10 full blocks
    first = request("a", prompt)
    hits, num_cached, _ = kv.get_computed_blocks(first)
    assert kv.allocate_slots("a", num_cached, 40, hits) is not None
    kv.cache_full_blocks(first, 40)
    kv.free("a")
    probe = request("b", prompt + [1])
    hit = kv.get_computed_blocks(probe)
    # A query at 40 reads from 36 (chunk 6): block 9 only; blocks 0-8 are None in the chunked group.
    assert hit.num_tokens == 40 and hit.blocks[2][:9] == [None] * 9 and hit.blocks[2][9] is not None
    # A block before the chunk start may go; the chunk's own block may not.
    kv.block_pool._evict(kv.block_pool.get_cached_block(probe.block_hashes[8], 2))
    assert kv.get_computed_blocks(probe).num_tokens == 40
    kv.block_pool._evict(kv.block_pool.get_cached_block(probe.block_hashes[9], 2))
    # The hit drops to 36, a chunk start: a query there reads no earlier key, so the chunked group needs none.
    hit = kv.get_computed_blocks(probe)
    assert hit.num_tokens == 36 and hit.blocks[2] == [None] * 9
    assert kv.allocate_slots("b", 36, 5, hit.blocks) is not None
    assert kv.num_released("b") == [0, 7, 9]
    kv.check_invariants({"b": 41}, swapped=())
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks


@given(chunk=st.integers(1, 40), window=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 8]),
       max_step=st.integers(1, 24), num_tokens=st.integers(2, 120), data=st.data())
@settings(max_examples=100, deadline=None)
def test_admissions_bound_holds_for_chunked_groups(chunk, window, block_size, max_step, num_tokens, data):
    layout = kv_group_layout([None, ChunkedLocal(chunk), window])
    assert_admissions_bound_holds(layout, block_size, max_step, num_tokens, data)


class ChunkedCoordinatorMachine(CoordinatorMachine):
    """The coordinator fuzz (prefix hits, growth, forks, swaps, speculation, frees in a
    small pool) over full, sliding and chunked groups: each group reads its own tokens
    from its kind's first read of the next query."""

    KINDS = LAYOUT.kinds


class TieredChunkedCoordinatorMachine(TieredCoordinatorMachine):
    """The tiered fuzz with chunked groups: their blocks go down and come back under their own key."""

    KINDS = LAYOUT.kinds


TestChunkedCoordinator = ChunkedCoordinatorMachine.TestCase
TestChunkedCoordinator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTieredChunkedCoordinator = TieredChunkedCoordinatorMachine.TestCase
TestTieredChunkedCoordinator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)

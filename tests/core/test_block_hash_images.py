"""Image-aware block hashes (torch-free): a block's hash covers the content hash of
every image whose placeholder tokens it covers, and the chain carries it onward."""

from __future__ import annotations

import pytest

from pagedllm.core.block_hash import extend_block_hashes, hash_request_tokens
from pagedllm.core.request import Request
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedllm.sampling_params import SamplingParams

TOKENS = list(range(64))  # four blocks of 16; the image sits in block 1 and block 2


def _hashes(identifier: str, offset: int = 20, length: int = 20) -> list[bytes]:
    return extend_block_hashes([], TOKENS, 16, ("salt",), [(offset, length, identifier)])


def test_another_image_changes_the_blocks_it_covers_and_every_later_one():
    a, b = _hashes("image-a"), _hashes("image-b")
    assert a[0] == b[0]  # before the image: shared
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # over it, and after it through the chain


def test_the_same_image_in_the_same_place_hashes_the_same():
    assert _hashes("image-a") == _hashes("image-a")


def test_a_block_that_only_touches_the_image_edge_is_not_keyed_by_it():
    """Placeholder [16, 32) lies in block 1 alone: block 0 ends where it starts."""
    plain = extend_block_hashes([], TOKENS, 16, ("salt",))
    keyed = extend_block_hashes([], TOKENS, 16, ("salt",), [(16, 16, "image-a")])
    assert keyed[0] == plain[0] and keyed[1] != plain[1]


def test_the_documented_image_test_vector():
    assert hash_request_tokens(list(range(16)), mm_spans=[(4, 4, "abc")]) == [6685555401624510419]


def test_a_requests_images_key_its_blocks_and_follow_its_forks():
    feature = MultiModalFeature("image", "image-a", PlaceholderRange(20, 20), embed_token_id=7, num_embeds=16)
    request = Request("r", TOKENS, SamplingParams(), eos_token_ids=[], max_tokens=4, cache_salt="salt",
                      mm_features=[feature])
    assert request.mm_spans == ((20, 20, "image-a"),)
    assert request.fork("r::1", 1, 0).mm_spans == request.mm_spans


def test_images_for_a_text_only_model_are_refused_on_the_way_to_an_engine_core_process():
    from pagedllm.core.prompt_tokens import tokenized

    with pytest.raises(ValueError, match="takes text only"):
        tokenized(None, {"prompt": "<image>", "multi_modal_data": {"image": [object()]}})


def test_a_blocks_events_carry_the_images_it_covers_as_extra_keys_in_the_pool_and_the_tiers():
    """vLLM's ``extra_keys`` per block: ["mm", content hash] for a block over an image, none otherwise
    (and never the cache salt), when the pool caches it, when a disk tier persists it and when the
    host tier takes it over from the pool."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.kv_events import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_POOL, BlockStored, KVEventLog
    from pagedllm.core.tier_index import TierIndex
    from pagedllm.kv_tiers.event_wire import to_wire
    from tests.kv_tiers.test_tier_index import DictDisk

    events = KVEventLog()
    tiers = TierIndex(host_capacity_blocks=8, disk=DictDisk(set()), events=events, block_size=16)
    kv = KVCacheManager(8, 16, events=events, tiers=tiers)
    feature = MultiModalFeature("image", "image-a", PlaceholderRange(20, 20), embed_token_id=7, num_embeds=16)
    request = Request("r", TOKENS, SamplingParams(), eos_token_ids=[], max_tokens=1, cache_salt="salt",
                      mm_features=[feature])
    assert kv.allocate_slots("r", 0, len(TOKENS)) is not None
    kv.cache_full_blocks(request, len(TOKENS))
    kv.free("r")
    assert kv.allocate_slots("other", 0, 8 * 16) is not None  # evicts r's cached blocks to the host tier
    kv.free("other")
    stored = [event for event in events.take() if isinstance(event, BlockStored)]
    expected = [None, [[["mm", "image-a"]]], [[["mm", "image-a"]]], None]
    hashes = hash_request_tokens(TOKENS, 16, "salt", mm_spans=[feature.span])
    for medium in (MEDIUM_POOL, MEDIUM_DISK, MEDIUM_HOST):
        wire = sorted(to_wire([event for event in stored if event.medium == medium]),
                      key=lambda event: hashes.index(event.block_hashes[0]))
        assert [event.block_hashes[0] for event in wire] == hashes, medium
        assert [event.extra_keys for event in wire] == expected, medium

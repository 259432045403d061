"""The encoder cache: by content hash, least recently used out first, within its byte budget."""

from __future__ import annotations

import torch

from pagedllm.worker.encoder_cache import EncoderCache

ROWS = torch.zeros(4, 8)  # 128 bytes


def _fill(cache: EncoderCache, key: str) -> torch.Tensor:
    return cache.get_or_compute(key, lambda: ROWS.clone())


def test_a_hit_returns_the_stored_output_without_computing():
    cache = EncoderCache(1024)
    first = _fill(cache, "a")
    encoder_seconds = cache.stats()["encoder_seconds"]
    assert encoder_seconds > 0  # the miss ran the encoder; the hit adds no encoder time
    assert cache.get_or_compute("a", lambda: (_ for _ in ()).throw(AssertionError("computed again"))) is first
    assert cache.stats()["encoder_cache_hits"] == 1 and cache.stats()["encoder_cache_misses"] == 1
    assert cache.stats()["encoder_seconds"] == encoder_seconds


def test_the_least_recently_used_goes_when_the_budget_is_passed():
    cache = EncoderCache(256)  # two entries
    _fill(cache, "a"), _fill(cache, "b"), _fill(cache, "a"), _fill(cache, "c")  # b is the least recent
    stats = cache.stats()
    assert (stats["encoder_cache_entries"], stats["encoder_cache_bytes"], stats["encoder_cache_evictions"]) == (2, 256, 1)
    _fill(cache, "a")
    assert cache.stats()["encoder_cache_hits"] == 2
    _fill(cache, "b")
    assert cache.stats()["encoder_cache_misses"] == 4


def test_an_output_over_the_budget_is_used_not_kept_and_zero_turns_it_off():
    for budget in (0, 64):
        cache = EncoderCache(budget)
        assert _fill(cache, "a").shape == ROWS.shape
        assert cache.stats()["encoder_cache_entries"] == 0

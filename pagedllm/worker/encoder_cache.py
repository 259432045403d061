"""Vision-encoder outputs by image content hash, in a byte budget.

A memo, never a source of truth: an entry is the encoder's output for exactly the
image its content hash names, so a hit equals a recompute, and an entry evicted
while its image is still being prefilled (in chunks) is only computed again. It
is shared by every request and by the chunks of one prefill, and outlives a
preemption by recompute."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    """Least recently used out first; an output larger than the whole budget is
    used and not kept (``budget_bytes=0`` turns the cache off)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = self.hits = self.misses = self.evictions = 0
        self.encoder_seconds = 0.0  # wall time in ``compute`` (the encoder): what the hits saved is absent here

    def get_or_compute(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry
        self.misses += 1
        started = time.perf_counter()
        value = compute()
        self.encoder_seconds += time.perf_counter() - started
        size = value.numel() * value.element_size()
        if size <= self.budget_bytes:
            self._entries[key] = value
            self.num_bytes += size
            while self.num_bytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.numel() * evicted.element_size()
                self.evictions += 1
        return value

    def stats(self) -> dict[str, int | float]:
        """What ``LLM.stats()`` reports: budget, use, hits / misses / evictions so far, and the seconds
        the encoder ran (every miss; with the cache off every image, once per prefill chunk that needs it)."""
        lookups = self.hits + self.misses
        return {"encoder_cache_budget_bytes": self.budget_bytes, "encoder_cache_bytes": self.num_bytes,
                "encoder_cache_entries": len(self._entries), "encoder_cache_hits": self.hits,
                "encoder_cache_misses": self.misses, "encoder_cache_hit_rate": self.hits / max(1, lookups),
                "encoder_cache_evictions": self.evictions, "encoder_seconds": self.encoder_seconds}

"""Fill a KV pool's never-written memory with values no reader may see.

The pool is allocated uninitialised (``attention.kv_cache.allocate_layer``):
its pages hold whatever the allocator hands back until a token is written.
Tests fill a fresh pool with NaN (and int8 / fp8 bytes with their largest or
NaN codes) to prove every reader ignores the slots it did not write, even the
masked ones: a NaN read under a mask of zeros still poisons a sum
(0 * NaN = NaN).
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache

# An int8 pool reads 127 as the largest value; for fp8 (stored as raw uint8 bytes), 0x7F is e4m3fn's NaN.
POISON_BYTE = 0x7F


def poison_tensor(tensor: torch.Tensor) -> None:
    tensor.fill_(float("nan") if tensor.is_floating_point() else POISON_BYTE)


def poison_layer(cache: LayerKVCache) -> None:
    """K, V, their scales and the full-precision tails, wherever present."""
    for tensor in (cache.key, cache.value, cache.key_scale, cache.value_scale, cache.tail_key, cache.tail_value):
        if tensor is not None:
            poison_tensor(tensor)


def poison_engine_pools(llm) -> None:
    """Every pool a fresh engine holds: the runner's device pool and its host swap pool."""
    runner = llm.llm_engine.runner
    for layer in runner.kv_caches:
        poison_layer(layer)
    poison_tensor(runner.host_store.swap_rows)

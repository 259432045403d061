"""A model's paged KV pool tensors: allocated, aliased per layer, pretouched.

Shared by the model runner and a speculative draft model: both keep a pool
indexed by the same block ids, and both carry out every step's block moves
(``worker/block_mover.py``).

Safety rule (hybrid KV layouts, ``core.kv_groups``): the pool is ``num_slots``
slot caches, and the model's per-layer list (``layer_caches``) aliases them.
The block mover, the host store's codec and pretouch work on the
slot caches only: moving an alias would move its slot twice. LoRA pages are
written and read per layer, each layer in its group's stretch of an adapter's
run (``lora/page_layout.py``), so the layers sharing a slot never overlap.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedllm.attention.kv_cache import LayerKVCache, allocate_layer
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.model.base import CausalLM
from pagedllm.model.shapes import head_dim_of
from pagedllm.kv_tiers.host import HostKVStore


def allocate_caches(model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str, device: torch.device, tails: bool = False,
                    num_slots: int | None = None) -> list[LayerKVCache]:
    """One block-major slot cache per slot of a block (``num_slots``; None: one
    per layer of ``model``), each with ``model``'s share of KV heads under tensor
    parallelism: one block of one slot is one slab; with ``tails`` (int8), each
    slot's full-precision tails over its own blocks' bytes."""
    config = model.config
    return [
        allocate_layer(num_blocks, block_size, model.num_kv_heads, head_dim_of(config), dtype, kv_cache_dtype, device,
                       tails)
        for _ in range(config.num_hidden_layers if num_slots is None else num_slots)
    ]


def layer_caches(slot_caches: list[LayerKVCache], layout: KVGroupLayout) -> list[LayerKVCache]:
    """The model's per-layer caches: layer ``l`` shares the tensors of slot cache
    ``slot_of_layer[l]`` and reads the tables of group ``group_of_layer[l]``.
    With one group it is ``slot_caches`` itself (slot ``l`` is layer ``l``)."""
    if not layout.is_hybrid:
        return slot_caches
    return [replace(slot_caches[slot], group=group)
            for slot, group in zip(layout.slot_of_layer, layout.group_of_layer)]


def pretouch_pool(kv_caches: list[LayerKVCache], host: HostKVStore) -> None:
    """Make a pool and its host swap space resident now (``kv_cache_pretouch``):
    both are allocated uninitialised and otherwise take memory as blocks are written."""
    for layer in kv_caches:
        layer.pretouch()
    host.pretouch()

"""A model's paged KV pool tensors, and the block moves a step asks for.

Shared by the model runner and a speculative draft model: both keep a pool
indexed by the same block ids, so both must perform every copy and swap.

Safety rule (hybrid KV layouts, ``core.kv_groups``): the pool is ``num_slots``
slot caches, and the model's per-layer list (``layer_caches``) aliases them.
Every mover here, the swap pool, the tiers' codec and pretouch work on the
slot caches only: moving an alias would move its slot twice. LoRA pages are
written and read per layer, each layer in its group's stretch of an adapter's
run (``lora/page_layout.py``), so the layers sharing a slot never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pagedllm.attention.kv_cache import LayerKVCache, allocate_layer
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.model.base import CausalLM
from pagedllm.model.shapes import head_dim_of
from pagedllm.worker.swap import HostSwapPool


def allocate_caches(model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str, device: torch.device, num_tail_slots: int = 0,
                    num_slots: int | None = None) -> list[LayerKVCache]:
    """One block-major slot cache per slot of a block (``num_slots``; None: one
    per layer of ``model``), each with ``model``'s share of KV heads under tensor
    parallelism: one block of one slot is one slab; with ``num_tail_slots``
    (int8), each slot's full-precision tails."""
    config = model.config
    return [
        allocate_layer(num_blocks, block_size, model.num_kv_heads, head_dim_of(config), dtype, kv_cache_dtype, device,
                       num_tail_slots)
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


def pretouch_pool(kv_caches: list[LayerKVCache], swap_pool: HostSwapPool) -> None:
    """Make a pool and its host swap space resident now (``kv_cache_pretouch``):
    both are allocated uninitialised and otherwise take memory as blocks are written."""
    for layer in kv_caches:
        layer.pretouch()
    swap_pool.pretouch()


def move_blocks(
    kv_caches: list[LayerKVCache],
    swap_pool: HostSwapPool,
    swap_out: list[tuple[int, int]],
    copies: list[tuple[int, int]],
    swap_in: list[tuple[int, int]],
) -> None:
    """Swap out, copy, swap in: in this order, because a block swapped out may
    be reused as a copy or swap-in target in the same step."""
    swap_pool.swap_out(kv_caches, swap_out)
    copy_blocks(kv_caches, copies)
    swap_pool.swap_in(kv_caches, swap_in)


def copy_blocks(kv_caches: list[LayerKVCache], copies: list[tuple[int, int]]) -> None:
    """Copy whole physical blocks ``(src, dst)``, every layer. The gather reads
    all sources before the scatter writes, so the copies of one step never see
    each other's results."""
    _per_layer(kv_caches, copies, _copy_layer_blocks)


def _copy_layer_blocks(layer: LayerKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    for tensor in layer.tensors():  # K, V and, when quantized, their scales
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


@dataclass
class TailMoves:
    """One step's tail slot moves for int8 pools with tails (``pagedllm.worker.tail_slots``)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (tail slot, host block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src slot, dst slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, tail slot)
    fills: list[tuple[int, int]] = field(default_factory=list)  # (block, tail slot): from its int8 values


def move_tails(kv_caches: list[LayerKVCache], swap_pool: HostSwapPool, moves: TailMoves) -> None:
    """After the block moves, every layer, in this order: tails out to the host
    (before a freed slot is reused), slot copies (all sources read first),
    tails back in, then fills, which read a block as this step's block moves
    left it."""
    swap_pool.swap_out_tails(kv_caches, moves.swap_out)
    _per_layer(kv_caches, moves.copies, LayerKVCache.copy_tails)
    swap_pool.swap_in_tails(kv_caches, moves.swap_in)
    _per_layer(kv_caches, moves.fills, LayerKVCache.fill_tails)


def _per_layer(kv_caches: list[LayerKVCache], pairs: list[tuple[int, int]], move) -> None:
    """``move(layer, firsts, seconds)`` of ``pairs`` as index tensors, every layer."""
    if not pairs:
        return
    device = kv_caches[0].key.device
    firsts = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    seconds = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    for layer in kv_caches:
        move(layer, firsts, seconds)

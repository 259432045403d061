"""A model's paged KV pool tensors, and the block moves a step asks for.

Shared by the model runner and a speculative draft model: both keep a pool
indexed by the same block ids, so both must perform every copy and swap.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache, allocate_layer
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.shapes import head_dim_of
from pagedllm.worker.swap import HostSwapPool


def allocate_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str, device: torch.device) -> list[LayerKVCache]:
    """One block-major layer cache per layer of ``model`` (its share of KV
    heads under tensor parallelism): one block of one layer is one slab."""
    config = model.config
    return [
        allocate_layer(num_blocks, block_size, model.num_kv_heads, head_dim_of(config), dtype, kv_cache_dtype, device)
        for _ in range(config.num_hidden_layers)
    ]


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
    if not copies:
        return
    device = kv_caches[0].key.device
    src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=device)
    for layer in kv_caches:
        for tensor in layer.tensors():  # K, V and, when quantized, their scales
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

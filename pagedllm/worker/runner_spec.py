"""``RunnerSpec``: what every rank's model runner is built from.

The driver (rank 0) makes it once, from its pool plan and the engine's
configuration, builds its own runner from it and sends it to the other
tensor-parallel ranks, which build theirs from the same object: every rank's
pool then has the same block ids, block size, swap blocks and tail slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config.engine import EngineConfig, SchedulerConfig, torch_dtype
from pagedllm.core.kv_groups import KVGroupLayout
from pagedllm.worker.memory import PoolPlan, kv_groups_of


@dataclass(frozen=True)
class RunnerSpec:
    """One runner's pool and batch sizes (the same on every rank)."""

    num_blocks: int  # the scheduler's pool; a runner with CUDA graphs allocates one more as their pad block
    block_size: int
    num_swap_blocks: int  # host blocks for preemption_mode="swap" (0 otherwise)
    dtype: torch.dtype  # the model's, and the pool's unless kv_cache_dtype quantizes it
    kv_cache_dtype: str
    tails: bool  # int8 pools: full-precision tails of still-filling blocks (``worker.tail_slots``)
    max_num_seqs: int  # the persistent input batch's rows and the largest CUDA graph (the batch grows past them)
    max_model_len: int
    cuda_graphs: bool  # capture decode steps where the device and model allow (off: ``enforce_eager``)
    # The KV cache groups (``core.kv_groups``): the runner keeps ``num_slots`` slot
    # caches and one block table per group; one group of every layer without the hybrid manager.
    kv_groups: KVGroupLayout
    max_lora_rank: int = 0  # LoRA adapters' largest rank (0: LoRA off)
    encoder_cache_bytes: int = 0  # vision-encoder outputs kept by image hash (``worker/encoder_cache.py``)

    @classmethod
    def from_plan(cls, plan: PoolPlan, config: EngineConfig, scheduler_config: SchedulerConfig,
                  num_layers: int) -> RunnerSpec:
        """The spec of rank 0's ``plan`` (``plan_kv_pool``) for ``config``, with
        ``scheduler_config`` resolved against the model (its ``max_model_len``, its
        KV cache groups) of ``num_layers`` layers."""
        return cls(
            num_blocks=plan.num_blocks,
            block_size=plan.block_size,
            num_swap_blocks=plan.num_swap_blocks,
            dtype=torch_dtype(plan.dtype),
            kv_cache_dtype=plan.kv_cache_dtype,
            tails=plan.tail_run_blocks > 0,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.max_model_len,
            # A tensor-parallel forward's graph would capture its all-reduces,
            # which needs every rank capturing together: those steps run eagerly.
            # LoRA steps carry per-row adapter work a captured graph would not see.
            cuda_graphs=not config.enforce_eager and config.tensor_parallel_size == 1 and not config.lora.enable_lora,
            kv_groups=kv_groups_of(scheduler_config, num_layers),
            max_lora_rank=config.lora.max_lora_rank if config.lora.enable_lora else 0,
            encoder_cache_bytes=config.encoder_cache_bytes,
        )

"""One rank's model: the load sequence the engine (rank 0) and every
tensor-parallel worker share, so that all ranks cut their shards from the same
checkpoint with the same ``max_model_len``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from pagedllm.config.engine import EngineConfig, SchedulerConfig, torch_dtype
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.sharding import check_tensor_parallel_size
from pagedllm.model.base import CausalLM
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.registry import build_model
from pagedllm.model.rotary import context_window_of
from pagedllm.model.shapes import layer_attention_of


@dataclass(frozen=True)
class ModelShard:
    """What loading leaves behind once the checkpoint's weights are released."""

    model: CausalLM  # this rank's shard, on its device, in eval mode
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    path: str  # the checkpoint that was loaded, resolved
    scheduler_config: SchedulerConfig  # the engine's options resolved against the model (max_model_len, ...)


def load_model_shard(config: EngineConfig, device: torch.device, tp: TensorParallelGroup) -> ModelShard:
    """Load ``config.model`` and build rank ``tp.rank``'s shard of it on ``device``.

    Safety rules: every rank must pass the same ``config`` (workers receive the
    driver's), or their shards would not add up to one model. A
    ``tensor_parallel_size`` that leaves some rank without a KV head or MLP
    column, and a ``max_model_len`` beyond the model's window, raise
    ``ValueError`` before any weight is placed on the device; the engine calls
    this before it starts the other ranks so that such a mistake leaves no
    process behind. The whole checkpoint sits in host memory until the shard
    is built.
    """
    dtype = torch_dtype(config.dtype)
    checkpoint = load_checkpoint(config.model, dtype=dtype, gguf_weights=config.gguf_weights)
    scheduler_config = config.scheduler_config(context_window_of(checkpoint.config),
                                               layer_attention_of(checkpoint.config))
    check_tensor_parallel_size(checkpoint.config, tp.world_size)
    model = build_model(checkpoint, scheduler_config.max_model_len, device, dtype, tp)
    shard = ModelShard(model, checkpoint.config, checkpoint.tokenizer, checkpoint.path, scheduler_config)
    del checkpoint, model  # the checkpoint's host buffers go now, before the pool is sized
    if device.type == "cpu":
        _release_freed_host_memory()
    return shard


def _release_freed_host_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing
    elsewhere). Loading frees whole weight copies (dtype conversions, fused parts,
    dense weights replaced by packed ones) and glibc keeps such blocks mapped:
    without this a bf16 SmolLM2 holds ~240 MiB more resident memory than its
    tensors, which the CPU pool sizing (free memory after load) would count as taken."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass

"""What the engine derives from its config and the loaded checkpoint at start-up:
the KV cache manager over the planned pool, the EOS ids, the sampling defaults."""

from __future__ import annotations

import gc
from typing import Any

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from pagedllm.config.engine import CacheConfig, EngineConfig, SchedulerConfig, sampling_overrides
from pagedllm.config.lora import LoRAConfig
from pagedllm.core.contiguous import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_interface import KVCacheManagerProtocol
from pagedllm.engine.kv_channels import KVChannels
from pagedllm.logger import init_logger
from pagedllm.lora.registry import AdapterRegistry
from pagedllm.model.loader import generation_defaults, generation_eos_token_ids
from pagedllm.worker.memory import PoolPlan

logger = init_logger(__name__)


def create_kv_cache_manager(cache: CacheConfig, plan: PoolPlan, scheduler_config: SchedulerConfig,
                            channels: KVChannels, lora: LoRAConfig) -> KVCacheManagerProtocol:
    """The block bookkeeping over the planned pool: paged, one table per KV
    cache group (with the tiers' index, the event log, an int8 pool's tails and,
    with ``enable_lora``, the adapters' pages, if any), or the contiguous
    baseline (one group only)."""
    num_blocks, block_size = plan.num_blocks, plan.block_size
    groups = scheduler_config.kv_groups
    if cache.kv_layout == "contiguous":
        reservation = cache.contiguous_reservation
        tokens = {"max_model_len": scheduler_config.max_model_len, "request": None}.get(reservation, reservation)
        return ContiguousKVCacheManager(num_blocks, block_size, tokens)
    return KVCacheManager(num_blocks, block_size, cache.enable_block_sharing, cache.enable_prefix_caching,
                          plan.num_swap_blocks, windows=(None,) if groups is None else groups.kinds,
                          tiers=channels.tier_index, events=channels.events, enable_lora=lora.enable_lora,
                          max_loras=lora.max_loras, tail_run_blocks=plan.tail_run_blocks,
                          tails_per_request=plan.tails_per_request)


def create_lora(config: EngineConfig, model_config: PretrainedConfig, runner: Any,
                kv_cache_manager: KVCacheManagerProtocol) -> AdapterRegistry | None:
    """With ``enable_lora``: the adapter registry (sized by the runner's pages; the KV
    manager pages the adapters in); None without it. ``ValueError`` where LoRA cannot run yet."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    if config.cache.kv_layout != "paged":
        raise ValueError("enable_lora pages adapters into the KV pool's blocks: it needs kv_layout='paged'")
    num_blocks = kv_cache_manager.num_blocks
    return AdapterRegistry(model_config, lora.max_lora_rank, runner.adapter_page_elems, num_blocks,
                           config.tensor_parallel_size, runner.num_kv_groups)


def eos_token_ids_of(tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig, config: EngineConfig,
                     model_path: str) -> list[int]:
    """The tokenizer's and the model config's EOS ids, and with ``generation_config="auto"``
    those of the checkpoint's generation_config.json."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    if config.generation_config == "auto":
        ids.update(generation_eos_token_ids(model_path))
    return sorted(ids)


def sampling_defaults_of(config: EngineConfig, model_path: str) -> dict:
    """vLLM's ``--generation-config auto``: the checkpoint's sampling defaults
    for requests that leave a field unset (logged once), under
    ``--override-generation-config``'s."""
    defaults = generation_defaults(model_path) if config.generation_config == "auto" else {}
    defaults.update(sampling_overrides(config.override_generation_config))
    if defaults:
        logger.info("Default sampling parameters (generation_config.json unless --generation-config vllm, "
                    "then --override-generation-config): %s", defaults)
    return defaults


def freeze_long_lived_objects() -> None:
    """Move the long-lived model, tokenizer and pools out of the collector's view, so its
    passes stay short. Loading's garbage is young: a full pass would also walk every module
    object of torch and transformers (~0.2 s of a ~3 s cold start) to find a few dozen more."""
    gc.collect(1)
    gc.freeze()

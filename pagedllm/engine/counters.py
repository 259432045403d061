"""The engine's public counters (``LLM.stats()``, ``LLM.weight_bytes()``) and the live
pool view's data, read from the KV manager, the scheduler, the runner and the engine's
step totals."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.engine.llm_engine import LLMEngine


def count_step(engine: LLMEngine, scheduler_output: SchedulerOutput) -> set[str]:
    """Count a launched step in the engine's totals and stamp its user requests' first
    scheduled time; returns those requests' ids."""
    sequences = engine.scheduler.requests
    user_ids = {sequences[s.sequence_id].group_id for s in scheduler_output.scheduled}
    now = time.time()
    for user_id in user_ids:
        metrics = engine.requests[user_id].metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
    num_scheduled = len(scheduler_output.scheduled)
    engine.num_steps += 1
    engine.num_scheduled_sequences += num_scheduled
    engine.peak_running_per_step = max(engine.peak_running_per_step, num_scheduled)
    engine.num_batched_tokens += scheduler_output.total_num_scheduled_tokens
    return user_ids


def kv_pool_snapshot(engine: LLMEngine) -> dict:
    """Every block (state, ref count, owners, hashed) and the counters a live view shows next to it."""
    kv = engine.kv_cache_manager.stats()
    return {
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "kv_layout": engine.config.cache.kv_layout,
        "blocks": engine.kv_cache_manager.pool_snapshot(),
        "counters": {
            "blocks_in_use": kv.num_blocks_in_use,
            "cached_blocks": kv.num_cached_blocks,
            "free_blocks": kv.num_free_blocks,
            "usage": kv.usage,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
            "num_preemptions": engine.scheduler.num_preemptions,
            "num_running": engine.scheduler.num_running,
            "num_waiting": engine.scheduler.num_waiting,
        },
        # The KV cache groups (``core.kv_groups``): a block's "group" indexes this list.
        "kv_groups": _groups_view(engine),
        "tiers": _tiers_view(engine, kv),
        # Resident LoRA adapters (their pages are the blocks whose "adapter" names them).
        "adapters": _adapters_view(engine),
    }


def _groups_view(engine: LLMEngine) -> list[dict]:
    layout = engine.runner_spec.kv_groups
    return [{"kind": group.kind, "window": group.window, "chunk": group.chunk, "layers": list(group.layers)}
            for group in layout.groups]


def _adapters_view(engine: LLMEngine) -> list[dict]:
    return engine.kv_cache_manager.adapter_view()


def _tiers_view(engine: LLMEngine, kv) -> dict | None:
    """The tiers below the pool for the live view: what each holds and what it served."""
    tiers = engine.kv_tiers
    if tiers is None:
        return None
    stats = tiers.stats()
    view = {"host": {"blocks": kv.host_tier_blocks, "capacity_blocks": tiers.index.host_capacity_blocks,
                     "bytes": stats["host_tier_bytes"], "hits": kv.host_tier_hits, "offloads": kv.tier_offloads}}
    if tiers.runner.disk is not None:
        view["disk"] = {"enabled": stats["disk_tier_enabled"], "bytes": stats["disk_tier_bytes"],
                        "hits": kv.disk_tier_hits, "files_written": stats["disk_tier_files_written"],
                        "bad_files": kv.tier_fetch_failures}
    return view


def engine_stats(engine: LLMEngine) -> dict[str, int | float | str]:
    """The KV manager's ``KVCacheStats``, the scheduler's counts, the engine's
    step totals and, with speculative decoding, its counters."""
    kv = engine.kv_cache_manager.stats()
    scheduler = engine.scheduler
    return {
        **dataclasses.asdict(kv),
        "num_blocks_in_use": kv.num_blocks_in_use,
        "token_capacity": kv.num_blocks * kv.block_size,
        "bytes_per_token": engine.bytes_per_token,
        "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "num_preemptions": scheduler.num_preemptions,
        "num_recomputed_tokens": scheduler.num_recomputed_tokens,
        "num_swapped": scheduler.num_swapped,
        "num_steps": engine.num_steps,
        "num_scheduled_sequences": engine.num_scheduled_sequences,  # summed over steps
        # Sequences in the forward pass, averaged over steps: the achieved batch size.
        "mean_running_per_step": engine.num_scheduled_sequences / max(1, engine.num_steps),
        "peak_running_per_step": engine.peak_running_per_step,
        "num_batched_tokens": engine.num_batched_tokens,
        "tensor_parallel_size": engine.tp_size,
        # A shared prefix shorter than one block never hits: only full blocks are cached.
        "min_cacheable_prefix_tokens": kv.block_size,
        **engine.runner.speculation_stats(),
        **(engine.kv_tiers.stats() if engine.kv_tiers is not None else {}),
        **_lora_stats(engine),
        **(_encoder_stats(engine) if engine.runner.embedder is not None else {}),
    }


def _encoder_stats(engine: LLMEngine) -> dict[str, int | float]:
    """A vision-language engine's encoder cache, and the images its accepted requests held."""
    return {**engine.runner.embedder.cache.stats(), "mm_images_processed": engine.input_processor.num_images}


def _lora_stats(engine: LLMEngine) -> dict[str, int | float]:
    """What a multi-LoRA workload costs, for ``pagedllm bench lora`` and users alike: the
    size of an adapter page (one block's key rows of one layer, in values of the model's
    dtype: with it, ``lora.page_layout.adapter_layout`` says how many blocks an adapter takes)
    and, with LoRA on, the adapters paged in and the seconds their loads took."""
    stats: dict[str, int | float] = {"lora_page_elems": engine.runner.adapter_page_elems}
    loaded = engine.runner.adapters
    if loaded is not None:
        stats.update(lora_page_ins=engine.kv_cache_manager.num_adapter_page_ins, lora_loads=loaded.num_loads,
                     lora_load_seconds=loaded.load_seconds)
    return stats


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes held for the model's parameters and buffers, a tensor tied to another counted once."""
    tensors = {id(t): t for t in (*engine.model.parameters(), *engine.model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())

"""How much memory the KV pool may take when it is sized from the device.

Two rules: ``kv_cache_fraction`` takes a fraction of what is free after the
weights are loaded (CPU or GPU), and on CUDA ``gpu_memory_utilization`` is
vLLM's rule: the engine as a whole (weights, the peak activations of the
largest step, and the pool) stays within that fraction of the GPU's total
memory. The peak is measured by running one dummy step of the largest size
the scheduler may build before the pool exists.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.attention.kv_cache import allocate_layer


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory now (after the weights are loaded): the GPU's free
    memory, or the host's MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory instead")


def utilization_kv_budget(total_bytes: int, utilization: float, weights_bytes: int, peak_activation_bytes: int) -> int:
    """Bytes left for the pool when the engine may use ``utilization`` of
    ``total_bytes``; raises ``ValueError`` saying what to change when none is left."""
    allowed = int(total_bytes * utilization)
    budget = allowed - weights_bytes - peak_activation_bytes
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {allowed / gib:.2f} GiB, but the weights take "
            f"{weights_bytes / gib:.2f} GiB and the largest step's activations {peak_activation_bytes / gib:.2f} GiB, "
            "leaving nothing for the KV cache; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


@torch.inference_mode()
def run_dummy_step(model, attention, num_tokens: int, num_logit_rows: int, block_size: int,
                   kv_shape: tuple[int, int], dtype: torch.dtype, kv_cache_dtype: str, device: torch.device) -> None:
    """One forward pass of ``num_tokens`` fresh prompt tokens (the largest step
    the scheduler builds) into a throwaway pool just big enough for them, then
    the logits of ``num_logit_rows`` rows (the most sampled in one step)."""
    num_blocks = -(-num_tokens // block_size)
    kv_caches = [
        allocate_layer(num_blocks, block_size, *kv_shape, dtype, kv_cache_dtype, device)
        for _ in range(model.config.num_hidden_layers)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
        prefills=[PrefillSpan(0, num_tokens, num_tokens, torch.arange(num_blocks, device=device))],
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(input_ids, torch.arange(num_tokens, device=device), kv_caches, metadata, attention)
    model.compute_logits(hidden[: min(num_logit_rows, num_tokens)].contiguous()).float().log_softmax(-1)


def cuda_peak_activation_bytes(run_step, device: torch.device) -> int:
    """Peak bytes allocated by ``run_step()`` beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)

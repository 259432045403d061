"""Planning the KV pool: how many blocks, how many swap blocks, what a token costs.

``plan_kv_pool`` applies the sizing rules of ``CacheConfig`` in their order.
Two of them read the device: ``kv_cache_fraction`` takes a fraction of what is
free after the weights are loaded (CPU or GPU), and on CUDA
``gpu_memory_utilization`` is vLLM's rule: the engine as a whole (weights, the
peak activations of the largest step, and the pool) stays within that fraction
of the GPU's total memory. The peak is measured by running one dummy step of
the largest size the scheduler may build before the pool exists.

A hybrid KV layout (``core.kv_groups``) keeps ``num_slots`` layers' K/V per
block, not every layer's: each group's table has its own blocks, so the same
bytes hold ``num_layers / num_slots`` times the blocks, and a token of a group
costs only that group's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.attention.kv_cache import allocate_layer, kv_bytes_per_token_per_kv_head, tail_run_blocks
from pagedllm.attention.selector import attention_backend_for
from pagedllm.config.engine import CacheConfig, EngineConfig, SchedulerConfig, torch_dtype
from pagedllm.core.kv_groups import KVGroupLayout, kv_group_layout
from pagedllm.core.kv_managers.tail_runs import tails_pay, tails_per_request
from pagedllm.model.base import CausalLM
from pagedllm.model.shapes import head_dim_of, num_kv_heads_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class PoolPlan:
    """The KV pool rank 0 decided at start-up; every rank allocates ``num_blocks``
    blocks (and ``num_swap_blocks`` host blocks) of its own KV heads."""

    num_blocks: int
    block_size: int
    num_swap_blocks: int  # host blocks for preemption_mode="swap" (0 otherwise)
    bytes_per_token: int  # one token in this rank's pool, quantization scales included
    total_bytes_per_token: int  # one token over all ranks together
    unquantized_bytes_per_token: int  # one token in this rank's pool were K/V kept in the model dtype
    num_kv_heads: int  # this rank's
    total_num_kv_heads: int
    tensor_parallel_size: int
    dtype: str  # the model's dtype option, e.g. "float32"
    kv_cache_dtype: str
    device_type: str
    # A speculative draft model's pool, indexed by the same blocks (0: none).
    draft_bytes_per_token: int = 0
    # int8 (paged): each writing request's full-precision tails of still-filling
    # blocks, taken from these blocks (``core/kv_managers/tail_runs.py``): this many
    # tails of ``tail_run_blocks`` blocks each (0: no tails).
    tail_run_blocks: int = 0
    tails_per_request: int = 0
    # Why a paged int8 pool keeps no tails (too small for them to pay:
    # ``tails_pay``), for the capacity line; empty otherwise.
    tails_off: str = ""
    # The KV cache groups the pool serves (``core.kv_groups``); a block (and the
    # bytes per token above) holds ``kv_groups.num_slots`` layers. None: one group.
    kv_groups: KVGroupLayout | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        """This rank's blocks (quantization scales included)."""
        return self.num_tokens * self.bytes_per_token

    @property
    def draft_pool_bytes(self) -> int:
        """The draft model's pool over the same blocks (0: none)."""
        return self.num_tokens * self.draft_bytes_per_token

    @property
    def tail_blocks_per_request(self) -> int:
        """Blocks a writing request's tails take (0: no tails)."""
        return self.tail_run_blocks * self.tails_per_request

    @property
    def swap_bytes(self) -> int:
        """The host swap space, allocated up front (the draft model's blocks included)."""
        return self.num_swap_blocks * self.block_size * (self.bytes_per_token + self.draft_bytes_per_token)

    def capacity_line(self) -> str:
        """The start-up log line: blocks, tokens, bytes per token, storage, and with
        quantization or tensor parallelism what they change; then every other byte
        the pool takes (tails, the draft model's pool, swap space) and, with a draft
        pool or swap space, the sum of it all (else the line already states the
        sum: the blocks' MiB). The offload tiers are
        not here: ``KVChannels.describe`` (engine/kv_channels.py) appends their own
        sentence to this line.

        Safety rule: the line's start, ``KV cache: N blocks x B tokens = T tokens
        (P bytes/token, M MiB, storage) on device``, is parsed by tests, docs and
        BENCHMARKS.md readers; add to the line after it, never change it."""
        tokens = self.num_tokens
        storage = self.dtype if self.kv_cache_dtype == "auto" else f"{self.kv_cache_dtype} KV with per-token scales"
        line = (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {tokens} tokens "
            f"({self.bytes_per_token} bytes/token, {_mib(self.pool_bytes)}, {storage}) on {self.device_type}"
        )
        if self.kv_cache_dtype != "auto":
            gain = self.unquantized_bytes_per_token / self.bytes_per_token
            line += f"; {gain:.2f}x the tokens of a {self.dtype} pool of the same size"
        if self.tensor_parallel_size > 1:
            line += (f"; that is rank 0, with {self.num_kv_heads} of {self.total_num_kv_heads} KV heads; "
                     f"all {self.tensor_parallel_size} ranks together: {self.total_bytes_per_token} bytes/token, "
                     f"{_mib(tokens * self.total_bytes_per_token)}")
        return line + self._groups() + self._other_bytes()

    def _groups(self) -> str:
        """A hybrid layout's groups: what a pool token holds and what a token costs in each group."""
        groups = self.kv_groups
        if groups is None or not groups.is_hybrid:
            return ""
        per_layer = self.bytes_per_token // groups.num_slots
        return f"; a block holds {groups.num_slots} of the model's {groups.num_layers} layers, in {groups.describe(per_layer)}"

    def _other_bytes(self) -> str:
        """The capacity line's tail: tails, draft pool, swap space, their sum."""
        text = ""
        if self.tail_run_blocks:
            text += (f"; a writing sequence also keeps its still-filling blocks in {self.dtype}, in tails of "
                     f"{self.tail_run_blocks} of these blocks ({self.tails_per_request} per sequence)")
        if self.tails_off:
            text += f"; {self.tails_off}"
        if self.draft_bytes_per_token:
            text += (f"; the draft model's pool over the same blocks: {self.draft_bytes_per_token} bytes/token, "
                     f"{_mib(self.draft_pool_bytes)}")
        if self.num_swap_blocks:
            text += f"; host swap space {self.num_swap_blocks} blocks ({_mib(self.swap_bytes)}, taken as used"
            if self.tail_run_blocks:
                # Not preallocated: a swapped block's tail is copied out when it goes (kv_tiers/host.py).
                tail_bytes = self.unquantized_bytes_per_token * self.block_size
                text += f", plus {tail_bytes} bytes per swapped block that carries a tail"
            text += ")"
        if self.draft_bytes_per_token or self.num_swap_blocks:
            # Otherwise the sum is already stated: the blocks' MiB.
            on_device = self.pool_bytes + self.draft_pool_bytes
            text += f"; in all {_mib(on_device + self.swap_bytes)}"
            if self.device_type != "cpu" and self.swap_bytes:
                text += f" ({_mib(on_device)} on {self.device_type}, {_mib(self.swap_bytes)} of host memory)"
            if self.tensor_parallel_size > 1:
                text += " on rank 0"
        return text


def _mib(num_bytes: int | float) -> str:
    """Bytes as the capacity line writes them."""
    return f"{num_bytes / 2**20:.1f} MiB"


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       num_kv_heads: int | None = None, num_layers: int | None = None) -> int:
    """K and V, every layer (``num_layers`` of them: a hybrid pool's slots), every
    KV head (scales included): the pool's cost of one token; with ``num_kv_heads``,
    of one rank holding that many KV heads."""
    num_kv_heads = num_kv_heads or num_kv_heads_of(config)
    per_head = kv_bytes_per_token_per_kv_head(head_dim_of(config), dtype, kv_cache_dtype)
    return (config.num_hidden_layers if num_layers is None else num_layers) * num_kv_heads * per_head


def kv_groups_of(scheduler_config: SchedulerConfig, num_layers: int) -> KVGroupLayout:
    """The scheduler's KV cache groups; without any (``kv_groups`` None), one
    full-attention group of the model's ``num_layers`` layers."""
    return scheduler_config.kv_groups or kv_group_layout([None] * num_layers)


def plan_kv_pool(config: EngineConfig, model: CausalLM, scheduler_config: SchedulerConfig,
                 device: torch.device, draft_model: CausalLM | None = None) -> PoolPlan:
    """Size rank 0's pool from ``config.cache`` for ``model`` (rank 0's shard) on ``device``.

    The first rule that is set decides: ``num_kv_blocks``, then
    ``kv_cache_memory``, then ``kv_cache_fraction`` of the memory available
    now, then on CUDA ``gpu_memory_utilization`` (0.9 by default), else on CPU
    ``DEFAULT_KV_CACHE_MEMORY``. A speculative ``draft_model`` keeps a pool
    over the same block ids, so a block costs both models' bytes. An int8 pool's
    full-precision tails are its own blocks, taken as sequences write (``tail_runs``),
    so they cost the budget nothing up front (the capacity line states them); a
    pool too small for them to pay keeps none (``_tail_plan``). Swap blocks exist
    only with ``preemption_mode="swap"`` and the paged layout, ``swap_space`` GiB
    of them, beside the budget.

    Safety rules: call it after the weights are on the device and before any
    pool is allocated, since the memory rules measure what is left. On CUDA
    without an explicit size it runs one forward pass of the model, which is
    why tensor parallelism on GPUs needs ``kv_cache_memory`` (bytes per rank)
    or ``num_kv_blocks``: the other ranks are not there to join its
    all-reduces. Every configuration the pool cannot honour raises
    ``ValueError`` saying what to change.
    """
    cache = config.cache
    dtype = torch_dtype(config.dtype)
    groups = kv_groups_of(scheduler_config, model.config.num_hidden_layers)
    # Per rank (rank 0 holds the most KV heads when they do not split evenly):
    # the budget is per rank, and every rank has the same number of blocks.
    # A block holds num_slots layers (every layer with one group).
    slots = groups.num_slots
    bytes_per_token = kv_bytes_per_token(model.config, dtype, cache.kv_cache_dtype, model.num_kv_heads, slots)
    draft_bytes_per_token = 0 if draft_model is None else kv_bytes_per_token(draft_model.config, dtype,
                                                                             cache.kv_cache_dtype)
    bytes_per_block = (bytes_per_token + draft_bytes_per_token) * cache.block_size
    unquantized_bytes_per_token = kv_bytes_per_token(model.config, dtype, "auto", model.num_kv_heads, slots)
    num_blocks, memory = _num_blocks(config, model, scheduler_config, device, bytes_per_block)
    draft_unquantized = 0 if draft_model is None else kv_bytes_per_token(draft_model.config, dtype)
    unquantized_blocks = memory // ((unquantized_bytes_per_token + draft_unquantized) * cache.block_size)
    run_blocks, per_request, tails_off = _tail_plan(config, groups.num_groups, num_blocks, unquantized_blocks)
    swaps = config.preemption_mode == "swap" and cache.kv_layout == "paged"
    return PoolPlan(
        num_blocks=num_blocks,
        block_size=cache.block_size,
        num_swap_blocks=int(config.swap_space * 2**30) // bytes_per_block if swaps else 0,
        bytes_per_token=bytes_per_token,
        total_bytes_per_token=kv_bytes_per_token(model.config, dtype, cache.kv_cache_dtype, num_layers=slots),
        # What the same memory would hold unquantized: the start-up line reports the gain.
        unquantized_bytes_per_token=unquantized_bytes_per_token,
        num_kv_heads=model.num_kv_heads,
        total_num_kv_heads=num_kv_heads_of(model.config),
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=config.dtype,
        kv_cache_dtype=cache.kv_cache_dtype,
        device_type=device.type,
        draft_bytes_per_token=draft_bytes_per_token,
        tail_run_blocks=run_blocks,
        tails_per_request=per_request,
        tails_off=tails_off,
        kv_groups=groups if groups.is_hybrid else None,
    )


def _tail_plan(config: EngineConfig, num_groups: int, num_blocks: int,
               unquantized_blocks: int) -> tuple[int, int, str]:
    """``(tail_run_blocks, tails_per_request, tails_off)`` of a pool of
    ``num_blocks``: tails for a paged int8 pool where they pay (``tails_pay``: a
    request alone keeps more blocks beside them than ``unquantized_blocks``, what
    the same memory holds in the model's dtype, both models' with a draft model),
    else none, with the reason the capacity line gives."""
    cache = config.cache
    num_spec = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    # The contiguous baseline holds no tails: its partial blocks read as int8 (docs/paging.md).
    if cache.kv_cache_dtype != "int8" or cache.kv_layout != "paged":
        return 0, 0, ""
    run = tail_run_blocks(torch_dtype(config.dtype))
    per_request = tails_per_request(num_groups, cache.block_size, num_spec)
    tail_blocks = run * per_request
    if tails_pay(num_blocks, tail_blocks, unquantized_blocks):
        return run, per_request, ""
    return 0, 0, (f"no full-precision tails: the pool is too small for them to pay (beside one sequence's "
                  f"tails, {tail_blocks} blocks, it would hold no more blocks than "
                  f"a {config.dtype} pool of the same memory, {unquantized_blocks}; they pay from "
                  f"{unquantized_blocks + tail_blocks + 1} blocks), so still-filling blocks are read as int8")


def _num_blocks(config: EngineConfig, model: CausalLM, scheduler_config: SchedulerConfig, device: torch.device,
                bytes_per_block: int) -> tuple[int, int]:
    """``(blocks, bytes)``: ``num_kv_blocks`` exactly, else the most blocks the
    first memory rule's budget holds, with the bytes they stand for (the budget,
    or the blocks' own); ``ValueError`` when the budget holds no block."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks, cache.num_kv_blocks * bytes_per_block
    budget = _kv_budget_bytes(config, model, scheduler_config, device)
    if budget < bytes_per_block:
        raise ValueError(
            f"the KV budget of {budget} bytes holds no block of {cache.block_size} tokens "
            f"({bytes_per_block} bytes); raise kv_cache_memory or kv_cache_fraction"
        )
    return budget // bytes_per_block, budget


def _kv_budget_bytes(config: EngineConfig, model: CausalLM, scheduler_config: SchedulerConfig,
                     device: torch.device) -> int:
    """Bytes for the pool by the first memory rule that applies (``num_kv_blocks`` is not one)."""
    cache = config.cache
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if config.tensor_parallel_size > 1 and device.type == "cuda":
        raise ValueError("with tensor_parallel_size > 1 on GPUs, size the pool with kv_cache_memory "
                         "(bytes per rank) or num_kv_blocks")
    if cache.kv_cache_fraction is not None:
        return int(available_memory_bytes(device) * cache.kv_cache_fraction)
    if device.type == "cuda":
        return _gpu_utilization_budget(model, scheduler_config, cache, torch_dtype(config.dtype), device)
    if cache.gpu_memory_utilization is not None:
        raise ValueError(
            f"gpu_memory_utilization applies to CUDA devices and this engine runs on {device}; "
            "size the pool with kv_cache_memory or kv_cache_fraction instead"
        )
    return cache.DEFAULT_KV_CACHE_MEMORY


def _gpu_utilization_budget(model: CausalLM, scheduler_config: SchedulerConfig, cache: CacheConfig,
                           dtype: torch.dtype, device: torch.device) -> int:
    """vLLM's rule: weights + the largest step's activations + the pool stay
    within ``gpu_memory_utilization`` of the GPU's total memory. Runs one dummy
    step of ``model`` (one rank: it does not join other ranks' all-reduces)."""
    utilization = cache.gpu_memory_utilization or CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION
    kv_shape = (model.num_kv_heads, head_dim_of(model.config))
    attention = attention_backend_for(device, cache.block_size, cache.kv_cache_dtype,
                                      tails=cache.kv_cache_dtype == "int8", dtype=dtype)
    weights_bytes = torch.cuda.memory_allocated(device)
    peak = cuda_peak_activation_bytes(
        lambda: run_dummy_step(model, attention, scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
                               cache.block_size, kv_shape, dtype, cache.kv_cache_dtype, device),
        device,
    )
    total = torch.cuda.get_device_properties(device).total_memory
    return utilization_kv_budget(total, utilization, weights_bytes, peak)


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
def run_dummy_step(model: CausalLM, attention, num_tokens: int, num_logit_rows: int, block_size: int,
                   kv_shape: tuple[int, int], dtype: torch.dtype, kv_cache_dtype: str, device: torch.device) -> None:
    """One forward pass of ``num_tokens`` fresh prompt tokens (the largest step
    the scheduler builds) into a throwaway pool just big enough for them, then
    the logits of ``num_logit_rows`` rows (the most sampled in one step). An
    int8 pool gets its full-precision tails, so the prefill measured is the one
    the engine runs (``kv_cache``'s reading rule): one tail, in blocks past the prompt's."""
    num_blocks = -(-num_tokens // block_size)
    tails = kv_cache_dtype == "int8"
    run = tail_run_blocks(dtype)
    tail_slot = -(-num_blocks // run)  # the first tail slot whose run lies past the prompt's blocks
    kv_caches = [
        allocate_layer((tail_slot + 1) * run if tails else num_blocks, block_size, *kv_shape, dtype, kv_cache_dtype,
                       device, tails=tails)
        for _ in range(model.config.num_hidden_layers)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
        prefills=[PrefillSpan(0, num_tokens, num_tokens, torch.arange(num_blocks, device=device))],
    )
    if tails:
        # The last block's tokens also go to the tail (a full last block writes none).
        last = (num_tokens - 1) // block_size * block_size if num_tokens % block_size else num_tokens
        metadata.tail_write_rows = torch.arange(last, num_tokens, device=device)
        metadata.tail_write_slots = metadata.tail_write_rows - last + tail_slot * block_size
        metadata.decode_tail_slots = torch.zeros(0, dtype=torch.long, device=device)
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

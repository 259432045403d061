"""Engine configuration, validated when built.

Every check raises ``ValueError`` naming the option and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.utils import check_block_size

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``dtype`` option value (torch is imported only here,
    so the bookkeeping that reads this module stays torch-free)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    import torch

    return getattr(torch, name)


@dataclass
class CacheConfig:
    """How big the paged KV pool is.

    Exactly one sizing rule applies, in this order: ``num_kv_blocks`` (exact,
    for tests and benchmarks, like vLLM's ``num_gpu_blocks_override``), then
    ``kv_cache_memory`` (bytes), then ``kv_cache_fraction`` of the memory
    available after the weights are loaded. With none of those, on CUDA the
    engine follows vLLM's ``gpu_memory_utilization`` (weights + the largest
    step's activations + the pool within that fraction of the GPU's total
    memory, 0.9 by default); on CPU the pool gets ``DEFAULT_KV_CACHE_MEMORY``
    bytes (``gpu_memory_utilization`` there is a ``ValueError``).
    """

    DEFAULT_KV_CACHE_MEMORY = 2 * 2**30
    DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None
    # False gives every forked sequence private copies of its parent's blocks:
    # the no-sharing baseline that `pagedllm bench sharing` compares against.
    enable_block_sharing: bool = True
    # Automatic prefix caching: full blocks are found again by their chained hash.
    enable_prefix_caching: bool = True
    # "paged" (blocks on demand) or "contiguous" (the baseline: one first-fit
    # reservation per request of `contiguous_reservation` tokens: "max_model_len",
    # "request" (its prompt + max_tokens) or a number of tokens).
    kv_layout: str = "paged"
    contiguous_reservation: int | str = "max_model_len"
    # "auto" stores K/V in the model dtype; "int8" / "fp8_e4m3" quantize each
    # (token, KV head) vector with its own fp32 scale (attention/kv_cache.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        reservation = self.contiguous_reservation
        if reservation not in ("max_model_len", "request") and (
            isinstance(reservation, bool) or not isinstance(reservation, int) or reservation < 1
        ):
            raise ValueError(
                f"contiguous_reservation must be 'max_model_len', 'request' or a number of tokens >= 1, got {reservation!r}"
            )
        check_block_size(self.block_size)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.kv_cache_fraction is not None and not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")


@dataclass
class SchedulerConfig:
    """Per-step budget of the continuous-batching scheduler.

    ``max_model_len`` is the model's context window (prompt + output);
    ``max_num_batched_tokens`` bounds the tokens of one forward pass and
    ``max_num_seqs`` the requests in it. Without chunked prefill a whole prompt
    must fit in one step, so ``max_num_batched_tokens >= max_model_len``.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap" (falls back to recompute when the swap space is full)
    scheduling_policy: str = "fcfs"  # or "priority": lower `priority` value is served first
    # Most prompt tokens one request may prefill in one step (None: no cap), so a
    # huge prompt cannot stall everyone else's decoding.
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
                raise ValueError(f"long_prefill_token_threshold must be an integer >= 1 or None, got {threshold!r}")
            if not self.enable_chunked_prefill:
                raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}); raise it, lower max_model_len, or enable chunked prefill"
            )


@dataclass
class EngineConfig:
    """Everything ``LLMEngine`` needs. ``model=None`` is the embedded SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "float32"
    device: str | None = None  # None: "cuda" when available, else "cpu"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len) without chunking
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks (used with preemption_mode="swap")
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    debug_invariants: bool = False
    # Tensor parallelism: ranks over torch.distributed (gloo on CPU, NCCL on GPU).
    # Without an init method the engine spawns the other ranks on this machine;
    # with one (e.g. "tcp://host:port") it waits for `pagedllm worker` processes.
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    distributed_timeout_s: float = 60.0  # any collective that waits longer raises

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None (auto), got {self.device!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if not isinstance(self.distributed_timeout_s, (int, float)) or self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got {self.distributed_timeout_s!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """Resolve the defaults that depend on the loaded model."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context window ({model_max_len})"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )

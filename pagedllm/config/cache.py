"""The KV cache's options (``CacheConfig``): the pool's size and layout, its
storage type, and the tiers below it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from pagedllm.utils import check_block_size

KVCacheDType = Literal["auto", "int8", "fp8_e4m3"]
KVLayout = Literal["paged", "contiguous"]
ContiguousReservation = Literal["max_model_len", "request"]
KV_CACHE_DTYPES = get_args(KVCacheDType)


def check_choice(option: str, value: object, choices: object) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{option} must be one of {', '.join(allowed)}, got {value!r}")


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

    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    kv_cache_memory: int | None = field(default=None, metadata={"help": "KV pool size in bytes"})
    kv_cache_fraction: float | None = field(
        default=None, metadata={"help": "KV pool as a fraction of the memory free after the weights are loaded"}
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={"help": "CUDA only: fraction of GPU memory for weights + activations + KV pool (None: 0.9)"},
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "exact number of KV blocks (overrides the other sizing options)"}
    )
    enable_block_sharing: bool = field(
        default=True,
        metadata={"help": "forked sequences (n > 1, beam search) share their parent's blocks; off, each "
                          "gets private copies: the baseline `pagedllm bench sharing` compares against"},
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "automatic prefix caching: full blocks are found again by their chained hash"}
    )
    kv_layout: KVLayout = field(
        default="paged",
        metadata={"help": "paged (blocks on demand) or contiguous (the baseline: one first-fit reservation "
                          "per request of contiguous_reservation tokens)"},
    )
    contiguous_reservation: int | ContiguousReservation = field(
        default="max_model_len",
        metadata={"help": "tokens a contiguous-layout request reserves: max_model_len, request "
                          "(its prompt + max_tokens) or a number of tokens"},
    )
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata={"help": "KV storage: auto (the model dtype), or int8 / fp8_e4m3 with an fp32 scale "
                          "per (token, KV head) vector"},
    )
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata={"help": "keep every layer's blocks: one block table for all layers, even in a model that "
                          "mixes full and sliding-window layers (Gemma 2/3, gpt-oss), whose sliding layers "
                          "otherwise keep only their window's blocks (vLLM's flag of the same name)"},
    )
    kv_cache_pretouch: bool = field(
        default=False,
        metadata={"help": "write the whole KV pool (and the swap space) once at start, so its memory is "
                          "resident from the first request instead of growing as blocks fill (for servers)"},
    )

    kv_offload_host_bytes: int | None = field(
        default=None,
        metadata={"help": "host-memory tier under the pool, in bytes: evicted prefix-cache blocks are kept "
                          "there (LRU) and loaded back on a hit (None: no host tier)"},
    )
    kv_offload_dir: str | None = field(
        default=None,
        metadata={"help": "disk tier folder: cached blocks are written there behind the step and found again "
                          "after a restart or by other engines sharing it (None: no disk tier)"},
    )
    kv_offload_disk_bytes: int | None = field(
        default=None,
        metadata={"help": "most bytes the disk tier keeps in kv_offload_dir, least recently used removed first "
                          "(None: unbounded)"},
    )

    def __post_init__(self) -> None:
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KVCacheDType)
        check_choice("kv_layout", self.kv_layout, KVLayout)
        reservation = self.contiguous_reservation
        if reservation not in get_args(ContiguousReservation) and (
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

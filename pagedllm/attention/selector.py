"""Which paged decode kernel (and prefill kernel) runs on which device, pool storage and dtype.

CPU: the compiled C++ kernel (``pagedllm.kernels.cpu``), for pools in the
model's dtype or int8. CUDA: the Triton kernel (``pagedllm.kernels.triton_paged``)
when Triton is installed and the block size is a power of two, for the same
storage types, except an int8 pool with full-precision tails (``kv_cache``),
which the Triton kernel does not read (the C++ kernel does). Both kernels mask
by sliding window, not by chunk: a chunked local layer's decodes (Llama 4) take
PyTorch's gather path whatever the kernel (``TorchPagedAttention._decode``). Attention
sinks (gpt-oss, every layer): the C++ decode kernel reads them; the Triton one does not,
so on CUDA such a layer decodes through the same gather path. Its prefill spans attend
eagerly in PyTorch, never through the C++ prefill kernel (``TorchPagedAttention`` checks
the layer's options, not the selector). Anything else
(fp8 pools, ``PAGEDLLM_CPU_KERNEL=0`` on CPU, no Triton): None, and the
backend gathers through PyTorch, which runs on any device and storage type.

Prefill spans: the C++ bf16 kernel (``prefill_attention.cpp``) for bf16 models on
a CPU without AMX, where PyTorch's SDPA is no faster in bf16 than in fp32; PyTorch's
SDPA everywhere else (fp32 CPU, bf16 on an AMX CPU, CUDA).
"""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.torch_paged import DecodeKernel, PrefillKernel, TorchPagedAttention
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.kernels.cpu_features import cpu_has_amx
from pagedllm.kernels.triton_paged import paged_decode_attention as triton_paged_decode
from pagedllm.kernels.triton_paged import triton_paged_decode_available

_KERNEL_KV_CACHE_DTYPES = ("auto", "int8")


def paged_decode_kernel_for(device: torch.device, block_size: int, kv_cache_dtype: str = "auto",
                            tails: bool = False) -> DecodeKernel | None:
    """``tails``: the pools have full-precision tails (int8 only)."""
    if kv_cache_dtype not in _KERNEL_KV_CACHE_DTYPES:
        return None
    if device.type == "cpu":
        return cpu_decode if load_cpu_kernels() is not None else None
    if device.type == "cuda" and triton_paged_decode_available() and block_size & (block_size - 1) == 0 \
            and not tails:
        return triton_decode
    return None


def cpu_decode(query, kv_cache: LayerKVCache, block_tables, context_lens, scale,
               sliding_window: int | None = None, logits_soft_cap: float | None = None,
               tail_slots: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """The C++ kernel over a layer cache (it must have built: see ``load_cpu_kernels``);
    ``sinks`` [heads] in any float dtype (the kernel reads them as fp32)."""
    tails = (kv_cache.tail_key, kv_cache.tail_value, tail_slots) if tail_slots is not None else (None, None, None)
    return load_cpu_kernels().paged_decode_attention(query, kv_cache.key, kv_cache.value, kv_cache.key_scale,
                                                     kv_cache.value_scale, block_tables, context_lens, scale,
                                                     sliding_window or 0, logits_soft_cap or 0.0, *tails,
                                                     sinks=None if sinks is None else sinks.float().contiguous())


def triton_decode(query, kv_cache: LayerKVCache, block_tables, context_lens, scale,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  tail_slots: torch.Tensor | None = None):
    """The Triton kernel over a layer cache (one without tails: see the module doc)."""
    if tail_slots is not None:
        raise ValueError("the Triton decode kernel does not read full-precision tails")
    return triton_paged_decode(query, kv_cache.key, kv_cache.value, block_tables, context_lens, scale,
                               kv_cache.key_scale, kv_cache.value_scale, sliding_window, logits_soft_cap)


def prefill_kernel_for(device: torch.device, dtype: torch.dtype | None) -> PrefillKernel | None:
    """``dtype``: the model's activations (None: unknown, PyTorch's SDPA). On a CPU with
    AMX, PyTorch's bf16 SDPA runs its matmuls on AMX tiles and is 2x the C++ kernel
    from 128 tokens up (BENCHMARKS.md, "Issue 22 on an Intel Xeon with AMX"), so it
    keeps them there."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_amx() and load_cpu_kernels() is not None:
        return cpu_prefill
    return None


def cpu_prefill(query, key, value, scale: float, query_offset: int):
    """The C++ causal prefill kernel (it must have built: see ``load_cpu_kernels``)."""
    return load_cpu_kernels().prefill_attention(query, key, value, scale, query_offset)


def attention_backend_for(device: torch.device, block_size: int, kv_cache_dtype: str = "auto",
                          tails: bool = False, dtype: torch.dtype | None = None) -> TorchPagedAttention:
    """``dtype``: the model's activations, which pick the prefill kernel."""
    decode_kernel = paged_decode_kernel_for(device, block_size, kv_cache_dtype, tails)
    return TorchPagedAttention(decode_kernel, prefill_kernel_for(device, dtype),
                               decode_reads_sinks=decode_kernel is cpu_decode)

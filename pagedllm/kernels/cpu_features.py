"""What this CPU multiplies in hardware: the facts that matmul and attention routing
choose by, asked of PyTorch's cpuinfo once and kept here so every layer reads the
same answer.

Why they matter (BENCHMARKS.md, "Issue 22 on an Intel Xeon with AMX"): on a CPU
with AMX, oneDNN runs bf16 matmuls and PyTorch's bf16 SDPA on AMX tiles, flat in
cost from 1 to ~32 rows and several times faster than any AVX-512 kernel at prefill
sizes, so bf16 work above a few rows belongs to them there; fp32 has no AMX path,
and the C++ packed kernel beats MKL's sgemm on both Intel and AMD.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles (Intel Sapphire Rapids and later)."""
    return torch.cpu._is_amx_tile_supported()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 in hardware here (AVX-512 BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or cpu_has_amx()

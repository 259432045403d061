"""Which paged decode kernel runs on which device.

CPU: the compiled C++ kernel (``pagedllm.kernels.cpu``). CUDA: the Triton
kernel (``pagedllm.kernels.triton_paged``) when Triton is installed and the
block size is a power of two. Anything else, or ``PAGEDLLM_CPU_KERNEL=0`` on
CPU: None, and the backend gathers through PyTorch, which runs on any device.
"""

from __future__ import annotations

import torch

from pagedllm.attention.torch_paged import DecodeKernel, TorchPagedAttention
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.kernels.triton_paged import paged_decode_attention as triton_paged_decode
from pagedllm.kernels.triton_paged import triton_paged_decode_available


def paged_decode_kernel_for(device: torch.device, block_size: int) -> DecodeKernel | None:
    if device.type == "cpu":
        module = load_cpu_kernels()
        return module.paged_decode_attention if module is not None else None
    if device.type == "cuda" and triton_paged_decode_available() and block_size & (block_size - 1) == 0:
        return triton_paged_decode
    return None


def attention_backend_for(device: torch.device, block_size: int) -> TorchPagedAttention:
    return TorchPagedAttention(paged_decode_kernel_for(device, block_size))

"""Building blocks of a Llama-family decoder: linear, RMSNorm, gated MLP (the rotary
embedding is in ``rotary.py``).

On CPU, RMSNorm (with the residual add), the rotary embedding and the gated
MLP's silu(gate) * up each run as one fused C++ op (``pagedllm.kernels``) when the kernels built; the PyTorch
code next to them is the fallback and the reference, and both round to the
storage dtype where Hugging Face does. fp32 and bf16 matmuls over a few rows
(decode steps) run through the C++ small-batch linear, PyTorch's otherwise; larger
bf16 matmuls on a CPU without native bf16 arithmetic run in fp32 (see
``linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.kernels.cpu_features import cpu_has_amx, cpu_has_native_bf16


# Up to this many rows a matmul is a decode step's, bound by streaming the
# weights, and the C++ small-batch kernel beats MKL on SmolLM2's shapes (fp32: 1.7-2x
# at 4-8 rows, 1.2-1.5x at 16, 1.0-1.2x at 32-48, behind from 64: `pagedllm bench
# linear`; bf16 on a CPU without AVX-512 BF16: 2-3x oneDNN at 8-48 rows; bf16 with
# AVX-512 BF16, where the kernel multiplies with VDPBF16PS, on an AMD EPYC Zen 4:
# 1.3-1.5x oneDNN's native bf16 at 1-20 rows, 1.1x at 32, even at 48); larger
# batches and prefill go to MKL / oneDNN. Where the CPU has AVX-512, fp32 models'
# Linear layers (and bf16 ones where it has no AMX) are replaced by packed ones at
# load (``packed_linear``), so they come here only on other CPUs or with that
# packing turned off.
SMALL_BATCH_ROWS = 48
# bf16 on a CPU with AMX: oneDNN's AMX GEMM costs about the same from 1 to 32 rows
# (39-45 ms for one step's projections on one Sapphire Rapids-class core), the
# small-batch kernel grows with the rows (17 ms at 1, 37 at 8, 49 at 12, 72 at 20),
# so the kernel keeps only the steps of a few sequences there.
AMX_BF16_SMALL_BATCH_ROWS = 8


def small_batch_rows(dtype: torch.dtype) -> int:
    """The most rows a ``dtype`` matmul sends to the C++ small-batch kernel on this CPU."""
    return AMX_BF16_SMALL_BATCH_ROWS if dtype == torch.bfloat16 and cpu_has_amx() else SMALL_BATCH_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear``, through the C++ small-batch kernel for fp32 or bf16
    inputs of at most ``small_batch_rows(dtype)`` rows on CPU. Larger bf16 matmuls on a
    CPU without AVX-512 BF16 or AMX (where oneDNN emulates bf16, 2-4x slower than
    fp32) widen to fp32, multiply, and round once. Both sum in fp32 and round
    to bf16 once, as oneDNN does, but in another order: results agree to fp32
    rounding of the sums, not bit for bit."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_cpu:
        return nn.functional.linear(x, weight, bias)
    if x.shape[0] <= small_batch_rows(x.dtype) and x.stride(1) == 1 and weight.is_contiguous():
        kernels = cpu_kernels_for(x)
        if kernels is not None:
            return kernels.linear_small_batch(x, weight, bias)
    if x.dtype == torch.bfloat16 and not cpu_has_native_bf16():
        wide_bias = None if bias is None else bias.float()
        return nn.functional.linear(x.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return nn.functional.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` (the fused gate_up output), in one
    C++ pass for fp32/bf16 on CPU. Rounds where PyTorch's two ops do; its exp is
    ``fast_exp``'s, so results agree with PyTorch's to fp32 rounding."""
    if x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.stride(1) == 1:
        kernels = cpu_kernels_for(x)
        if kernels is not None:
            return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` (tanh approximation: Hugging Face's ``gelu_pytorch_tanh``,
    Gemma's activation) for ``x = [gate | up]``, in PyTorch's two ops."""
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up


# Hugging Face activation name -> act(gate) * up over the fused gate|up output.
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def _skip_init_on_meta(module: nn.Module, reset: Callable[[], None]) -> None:
    """Random initialisation, except for a model built on the meta device (its weights come
    from the checkpoint): PyTorch's meta kernels for the random ops import torch._dynamo,
    and with it Triton, which a CPU engine never needs."""
    if module.weight.device.type != "meta":
        reset()


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward is :func:`linear`."""

    def reset_parameters(self) -> None:
        _skip_init_on_meta(self, super().reset_parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``name`` of ``model`` (a layer swapped for its packed twin)."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class Embedding(nn.Embedding):
    """``nn.Embedding``, not initialised when built on the meta device."""

    def reset_parameters(self) -> None:
        _skip_init_on_meta(self, super().reset_parameters)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 as Hugging Face does so that
    bf16 models normalise identically."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``, first residual += x (in place) and return
        (norm(residual), residual): the decoder's add-then-norm in one pass."""
        kernels = cpu_kernels_for(x)
        if kernels is not None:
            out = kernels.rms_norm(x, self.weight, self.eps, residual)
        elif residual is not None:
            residual += x
            out = self._norm(residual)
        else:
            out = self._norm(x)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; ``activation``
    is a key of ``GATED_ACTIVATIONS`` (silu, or Gemma's gelu_pytorch_tanh).
    Under tensor parallelism ``intermediate_size`` is this rank's share: gate/up
    are column-parallel and down's partial sums are all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallelGroup = SINGLE,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
        self.tp = tp
        self.act_and_mul = GATED_ACTIVATIONS[activation]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(x))))

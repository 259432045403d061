"""Building blocks of a Llama-family decoder: linear, RMSNorm, rotary embedding, gated MLP.

On CPU, RMSNorm (with the residual add), the rotary embedding and the gated
MLP's silu(gate) * up each run as one fused C++ op (``pagedllm.kernels``) when the kernels built; the PyTorch
code next to them is the fallback and the reference, and both round to the
storage dtype where Hugging Face does. fp32 matmuls over a few rows (decode
steps) run through the C++ small-batch linear, PyTorch's otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.model.shapes import head_dim_of


# Up to this many rows an fp32 matmul is a decode step's, bound by streaming the
# weights, and the C++ small-batch kernel beats MKL on SmolLM2's shapes (1.7-2x at
# 4-8 rows, 1.2-1.5x at 16, 1.0-1.2x at 32-48, behind from 64: `pagedllm bench
# linear`); larger batches and prefill go to MKL.
SMALL_BATCH_ROWS = 48


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear``, through the C++ small-batch kernel for fp32
    inputs of at most ``SMALL_BATCH_ROWS`` rows on CPU. That kernel sums in
    another order than MKL, so results agree to fp32 rounding."""
    if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS
            and x.stride(1) == 1 and weight.is_contiguous()):
        kernels = cpu_kernels_for(x)
        if kernels is not None:
            return kernels.linear_small_batch(x, weight, bias)
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


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table.

    The inverse frequencies (including rope scaling: linear, llama3, yarn,
    longrope) come from transformers' own rope code, so scaling follows the
    config exactly as Hugging Face applies it. Rotation is the "rotate half"
    (NeoX) layout Hugging Face checkpoints use.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        # Models are built on the meta device and get their weights by assignment;
        # this table is not a weight, so it is computed on the CPU (moved with the model).
        with torch.device("cpu"):
            self._build_tables(config, head_dim, max_position)

    def _build_tables(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        inv_freq, attention_scaling = _rope_inv_freq(config)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(
                f"partial rotary embeddings are not supported (rope dim {inv_freq.numel() * 2}, head_dim {head_dim})"
            )
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, dim], k: [tokens, kv_heads, dim]; positions: [tokens].

        The C++ path rotates q and k in place (they may be views of the fused
        qkv output); the PyTorch path returns new tensors."""
        kernels = cpu_kernels_for(q)
        if kernels is not None:
            kernels.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' (length-dependent NTK scaling) is not supported")
    if rope_type == "default":
        return _default_rope_inv_freq(config)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def _default_rope_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """The unscaled RoPE frequencies, computed exactly as transformers'
    ``LlamaRotaryEmbedding.compute_default_rope_parameters`` does. Written out
    here because importing ``modeling_llama`` pulls in torch._dynamo and, with
    it, Triton (whose nanobind leak report then ends every CPU run)."""
    base = config.rope_parameters["rope_theta"]
    dim = head_dim_of(config)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


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

"""gpt-oss (``gpt_oss``): what sets it apart from the other mixtures of experts
(``moe_families``), as Hugging Face's ``modeling_gpt_oss`` computes it.

- Attention: q/k/v/o with biases (``attention_bias``), YaRN rope as configured (``rotary``),
  sliding-window layers where ``layer_types`` says ``sliding_attention`` (window
  ``sliding_window``), and on every layer a learned logit per head, ``sinks``, that joins the
  softmax's denominator (``AttentionBackend.forward``'s ``sinks``).
- Router: a linear layer with a bias, top-k of its logits, softmax over those k
  (``moe.routers``' ``topk_softmax``).
- Norms: RMSNorm whose weight multiplies in fp32, before rounding (``GptOssRMSNorm``).
- Experts: gate|up with biases, the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``
  with g = gate clamped above, down with biases (``moe.experts.clamped_swiglu``).

Its checkpoints store each expert stack as ``x @ W`` multiplies it, transposed from the other
families', with gate and up columns interleaved: ``gate_up_proj`` [E, H, 2I] (column 2i is
gate i, 2i + 1 is up i) and ``down_proj`` [E, I, H]; ``gpt_oss_expert_layout`` turns them into
the stacked ``[gate rows | up rows]`` layout of ``moe.experts`` at load. The hub's MXFP4
safetensors (``*_blocks`` / ``*_scales``) are refused: a bf16 or fp32 copy loads, or a GGUF
(llama.cpp's ``gpt-oss`` architecture, ``gguf_moe``), whose MXFP4 experts stay packed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.layers import RMSNorm
from pagedllm.model.llama import Attention
from pagedllm.model.rotary import RotaryEmbedding


class SinkAttention(Attention):
    """Llama's attention (with gpt-oss's q/k/v/o biases from ``attention_bias``) plus one sink
    logit per query head."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TensorParallelGroup,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, rotary, tp, sliding_window)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssRMSNorm(RMSNorm):
    """Hugging Face's ``GptOssRMSNorm``: the weight multiplies the fp32-normalised input before
    the one rounding to the model's dtype (``weight * x32`` promotes to fp32), where Llama's
    rounds the input first and multiplies in the model's dtype. In an fp32 model the two are one.
    In an fp16 model the weight is fp32, as Hugging Face keeps it (``fp32_norm_weights``)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            residual += x  # the residual add, in the model's dtype as Hugging Face's
            x = residual
        x32 = x.float()
        out = (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
        return out if residual is None else (out, residual)


def fp32_norm_weights(config: PretrainedConfig, dtype: torch.dtype) -> Callable[[str], bool]:
    """The checkpoint names loaded in fp32 whatever ``dtype``: Hugging Face's gpt-oss keeps its
    RMSNorm weights fp32 in fp16 models (``_keep_in_fp32_modules``: ``input_layernorm``,
    ``post_attention_layernorm``, ``norm``; bf16 and fp32 models take their dtype), and
    ``GptOssRMSNorm`` then multiplies the fp32-normalised input by the fp32 weight."""
    if config.model_type != "gpt_oss" or dtype != torch.float16:
        return lambda name: False
    return lambda name: name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) \
        or name.endswith("model.norm.weight")


def check_gpt_oss_config(config: PretrainedConfig) -> None:
    """ValueError for a gpt-oss checkpoint whose experts are MXFP4 (the hub's original files)."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method is not None:
        raise ValueError(f"gpt-oss checkpoints quantized with {method!r} are not supported from safetensors: "
                         "load a bf16 or fp32 copy (dequantized experts)")


def gpt_oss_expert_layout(state_dict: dict) -> None:
    """gpt-oss's tensors, in place, under the names and in the stacked layout of ``moe.experts``.
    A Hugging Face checkpoint's ``gate_up_proj`` [E, H, 2I] interleaved -> [E, 2I, H] (gate rows,
    then up rows), its bias [E, 2I] likewise, ``down_proj`` [E, I, H] -> [E, H, I]. A GGUF's
    (``gguf_moe``) expert weights are left to ``moe.packed_experts``; its gate and up biases
    [E, I] become one ``gate_up_proj_bias``, and ``self_attn.sinks.weight`` is ``sinks``."""
    _gguf_names(state_dict)
    for name in [n for n in state_dict if n.endswith(".mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate_up = state_dict.pop(name)
        state_dict[name] = torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2).contiguous()
        bias = state_dict.pop(f"{prefix}gate_up_proj_bias")
        state_dict[f"{prefix}gate_up_proj_bias"] = torch.cat((bias[..., ::2], bias[..., 1::2]), dim=-1)
        down = state_dict.pop(f"{prefix}down_proj")
        state_dict[f"{prefix}down_proj"] = down.transpose(1, 2).contiguous()


def _gguf_names(state_dict: dict) -> None:
    for name in [n for n in state_dict if n.endswith(".self_attn.sinks.weight")]:
        state_dict[name.removesuffix(".weight")] = state_dict.pop(name)
    for name in [n for n in state_dict if n.endswith(".mlp.experts.gate_proj.bias")]:
        prefix = name.removesuffix("gate_proj.bias")
        up = state_dict.pop(f"{prefix}up_proj.bias")
        state_dict[f"{prefix}gate_up_proj_bias"] = torch.cat((state_dict.pop(name), up), dim=-1)
        state_dict[f"{prefix}down_proj_bias"] = state_dict.pop(f"{prefix}down_proj.bias")

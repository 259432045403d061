"""Llama 4 text decoders with dense MLP layers over a paged KV pool.

A Llama-family decoder (``llama.py``'s attention, decoder layer, weight loading and LM head
are reused) with these differences, each as Hugging Face's ``modeling_llama4.py`` computes it:
- ``layer_types``: ``chunked_attention`` layers attend within their own
  ``attention_chunk_size``-token chunk (a query at p reads keys from p // C * C), the
  ``full_attention`` ones to every earlier token; the KV cache keeps a chunked layer's
  blocks only from the current chunk's start (``core/kv_managers/chunked_local.py``);
- ``no_rope_layers`` (1: rope, 0: none) and the rope is the interleaved (complex-pair) one,
  with whatever scaling the config's ``rope_parameters`` name (Llama 4's is ``llama3``);
- ``use_qk_norm``: on rope layers, q and k are L2-normalised per head (a weightless RMS
  norm, in fp32) after the rotation;
- ``attn_temperature_tuning``: on NoPE layers the query at position p is scaled by
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``;
- a dense layer's MLP is ``intermediate_size_mlp`` wide (``intermediate_size`` is the
  experts'), and its weights are named ``feed_forward``.
Mixtures of experts (``moe_layers``, Llama 4 Scout and Maverick) are refused (issue 57).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.layers import Embedding, RMSNorm
from pagedllm.model.llama import Attention, DecoderLayer, LlamaForCausalLM, check_silu, rope_layers_of
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.shapes import attention_chunks_of, head_dim_of

LLAMA4_MODEL_TYPES = ("llama4_text",)


class Llama4Attention(Attention):
    """Llama's attention with Llama 4's chunk, L2 q/k norm and NoPE temperature tuning."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding | None, tp: TensorParallelGroup,
                 attention_chunk: int | None) -> None:
        super().__init__(config, rotary, tp)
        self.attention_chunk = attention_chunk
        self.l2_norm_eps = config.rms_norm_eps if config.use_qk_norm and rotary is not None else None
        tuning = config.attn_temperature_tuning and rotary is None
        self.temperature = (config.floor_scale, config.attn_scale) if tuning else None

    def position(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k, metadata)
        if self.l2_norm_eps is not None:
            q, k = _l2_norm(q, self.l2_norm_eps), _l2_norm(k, self.l2_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``Llama4TextL2Norm``: x / rms(x) over each head, in fp32, cast back."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Model(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position, interleaved=True)
        # Llama's pre-norm block (add-then-norm) around Llama 4's attention.
        self.layers = nn.ModuleList(
            DecoderLayer(config, None, tp, attention=Llama4Attention(config, rotary if uses_rope else None, tp, chunk))
            for uses_rope, chunk in zip(rope_layers_of(config), attention_chunks_of(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def dense_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a dense Llama 4 config whose ``intermediate_size`` is its MLP's width
    (``intermediate_size_mlp``), as the shared layers and sharding read it; ValueError
    for a config with expert layers."""
    if getattr(config, "moe_layers", None):
        raise ValueError(f"this Llama 4 checkpoint has mixture-of-experts layers {list(config.moe_layers)}: "
                         "mixtures of experts are not supported yet (issue 57); only dense Llama 4 text "
                         "models (moe_layers=[]) run")
    dense = copy.copy(config)
    dense.intermediate_size = config.intermediate_size_mlp
    return dense


class Llama4ForCausalLM(LlamaForCausalLM):
    """Dense Llama 4 text models; loading and the LM head are Llama's, the MLP weights
    renamed from Hugging Face's ``feed_forward`` to the shared layer's ``mlp``."""

    model_types = LLAMA4_MODEL_TYPES

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(dense_config(config), max_position, tp)

    @staticmethod
    def build_decoder(config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> nn.Module:
        check_silu(config)
        return Llama4Model(config, max_position, tp)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        for name in [name for name in state_dict if ".feed_forward." in name]:
            state_dict[name.replace(".feed_forward.", ".mlp.")] = state_dict.pop(name)
        super().load_weights(state_dict)

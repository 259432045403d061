"""Gemma (1), Gemma 2 and Gemma 3 text decoders over a paged KV pool.

They are Llama-family decoders (``llama.py``'s attention, MLP, weight loading and LM
head are reused) with these differences, each as Hugging Face's
``modeling_gemma*.py`` computes it:
- RMSNorm scales by ``1 + weight``, in fp32, and rounds to the storage dtype once at
  the end (``GemmaRMSNorm``; Llama rounds before the weight);
- the embedding output is multiplied by sqrt(hidden_size) as a tensor of the model's
  dtype (in bf16 that is 25.25 for 640, not 25.298);
- the MLP's activation is ``gelu_pytorch_tanh``;
- Gemma 2/3: attention scale ``query_pre_attn_scalar ** -0.5``; sliding-window layers
  (``config.layer_types``); norms after attention and after the MLP as well as before
  them ("sandwich"); Gemma 2 soft-caps attention scores and final logits with
  ``cap * tanh(x / cap)``;
- Gemma 3: per-head q/k norms, and a rotary table per layer type (local layers use
  their own rope base, ``config.rope_parameters[layer_type]``).

Tensor parallelism needs nothing beyond the generic rules: the extra norms act on
all-reduced outputs or per head, and the soft caps are elementwise.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.sharding import shard_layout
from pagedllm.model.layers import Embedding, GatedMLP
from pagedllm.model.llama import Attention, LlamaForCausalLM
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.shapes import head_dim_of, sliding_windows_of

GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
# Gemma 2 and 3 normalise each sublayer's output too (post_attention_layernorm is then the
# norm after attention, not the one before the MLP as in Gemma 1 and Llama).
_SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text")


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` computed in fp32 and cast to x's dtype at the
    end, exactly as Hugging Face's Gemma RMSNorm (weights are stored as offsets from 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale, per-layer window, score soft cap and
    (Gemma 3) q/k norms."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TensorParallelGroup,
                 layer_idx: int) -> None:
        super().__init__(config, rotary, tp, sliding_windows_of(config)[layer_idx])
        # Gemma 1 has no query_pre_attn_scalar: it scales by head_dim ** -0.5 as Llama does.
        scalar = getattr(config, "query_pre_attn_scalar", None)
        if scalar is not None:
            self.scale = scalar**-0.5
        self.logits_soft_cap = getattr(config, "attn_logit_softcapping", None)
        if config.model_type == "gemma3_text":
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """Pre-norm residual block; Gemma 2/3 also normalise each sublayer's output before
    adding it. Residual adds happen in the storage dtype, as Hugging Face's do."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TensorParallelGroup,
                 layer_idx: int) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        self.self_attn = GemmaAttention(config, rotary, tp, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, shard_layout(config, tp).intermediate_size, False, tp, activation)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.sandwich = config.model_type in _SANDWICH_NORM_TYPES
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: LayerKVCache,
                metadata: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """``hidden`` is the residual stream and is updated in place: it is the
        embedding's fresh output or the previous layer's, which nothing else holds."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, metadata, backend)
        if not self.sandwich:
            hidden += attn
            hidden += self.mlp(self.post_attention_layernorm(hidden))
            return hidden
        hidden += self.post_attention_layernorm(attn)
        hidden += self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden


def rotary_per_layer(config: PretrainedConfig, max_position: int) -> list[RotaryEmbedding]:
    """Each layer's rotary table. Gemma 3 keeps rope parameters per layer type
    (``rope_parameters[layer_type]``: local layers have their own base); one table is
    built per type, from a config copy holding that type's parameters. Otherwise one
    table serves every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or not all(isinstance(params.get(kind), dict) for kind in set(layer_types)):
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        return [rotary] * config.num_hidden_layers
    tables = {}
    for kind in sorted(set(layer_types)):
        type_config = copy.copy(config)
        type_config.rope_parameters = params[kind]
        tables[kind] = RotaryEmbedding(type_config, head_dim_of(config), max_position)
    return [tables[kind] for kind in layer_types]


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotaries = rotary_per_layer(config, max_position)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, rotaries[i], tp, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Not a weight (built on the CPU, not the meta device); cast with the model, so a
        # bf16 model scales by sqrt(hidden) rounded to bf16, as Hugging Face's does.
        with torch.device("cpu"):
            self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1/2/3 text models; weight loading (sharding, q/k/v and gate/up fusion, tied
    embeddings) and the LM head are Llama's, the final logits optionally soft-capped."""

    model_types = GEMMA_MODEL_TYPES

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    @staticmethod
    def build_decoder(config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> nn.Module:
        _check_supported(config)
        return GemmaModel(config, max_position, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                metadata: AttentionMetadata, backend: AttentionBackend,
                multimodal_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``multimodal_embeds`` (rows, embeddings): Gemma 3's image rows replace their tokens'
        embeddings after the sqrt(hidden) scaling, as Hugging Face's ``masked_scatter`` after
        its scaled embedding does (``model/gemma3_vision.py``)."""
        hidden = self.model.embed_tokens(input_ids)
        hidden *= self.model.embed_scale.to(hidden.dtype)
        if multimodal_embeds is not None:
            rows, embeds = multimodal_embeds
            hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, metadata, backend)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype; Gemma 2 soft-caps them (``cap * tanh(x / cap)``)."""
        logits = super().compute_logits(hidden)
        if self.final_soft_cap is None or hasattr(self, "score"):  # a classifier's labels are not capped
            return logits
        return torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap


def _check_supported(config: PretrainedConfig) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported; "
                         "only causal text generation is")

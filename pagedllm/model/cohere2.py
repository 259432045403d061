"""Cohere 2 (Command R7B, Command A) text decoders over a paged KV pool.

A Llama-family decoder (``llama.py``'s attention, gated MLP, weight loading and LM head
are reused) with these differences, each as Hugging Face's ``modeling_cohere2.py``
computes it:
- one norm per layer, and attention and the MLP both read its output: the layer adds
  both to the residual stream together ("parallel" block), in the storage dtype,
  attention first;
- the norms are LayerNorms without a bias (mean-centred, in fp32, rounded to the storage
  dtype once at the end), not RMSNorms;
- sliding-window layers (``config.layer_types``) rotate q and k with the interleaved
  (GPT-J) rope; full-attention layers use no positional embedding at all;
- the logits are multiplied by ``logit_scale`` (in the model's dtype).

Tensor parallelism needs nothing beyond the generic rules: attention's and the MLP's
outputs are each all-reduced before they are added, and the norms are replicated.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.layers import Embedding, GatedMLP
from pagedllm.model.llama import Attention, LlamaForCausalLM
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.sharding import shard_layout
from pagedllm.model.shapes import head_dim_of, sliding_windows_of

COHERE2_MODEL_TYPES = ("cohere2",)


class CohereLayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight``, without a bias, computed in fp32 and cast to
    x's dtype at the end, exactly as Hugging Face's ``Cohere2LayerNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        x32 = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class Cohere2DecoderLayer(nn.Module):
    """One norm, then attention and the MLP side by side, both added to the residual."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TensorParallelGroup,
                 sliding_window: int | None) -> None:
        super().__init__()
        # Only sliding layers know positions: the full-attention ones attend without a rope.
        self.self_attn = Attention(config, rotary if sliding_window is not None else None, tp, sliding_window)
        self.mlp = GatedMLP(config.hidden_size, shard_layout(config, tp).intermediate_size, False, tp,
                            config.hidden_act)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: LayerKVCache,
                metadata: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """``hidden`` is the residual stream and is updated in place: it is the
        embedding's fresh output or the previous layer's, which nothing else holds."""
        normed = self.input_layernorm(hidden)
        hidden += self.self_attn(positions, normed, kv_cache, metadata, backend)
        hidden += self.mlp(normed)
        return hidden


class Cohere2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position, interleaved=True)
        self.layers = nn.ModuleList(Cohere2DecoderLayer(config, rotary, tp, window)
                                    for window in sliding_windows_of(config))
        self.norm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Cohere 2 text models; weight loading (sharding, q/k/v and gate/up fusion, tied
    embeddings) and the LM head are Llama's, the logits scaled by ``logit_scale``."""

    model_types = COHERE2_MODEL_TYPES

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        self.logit_scale = config.logit_scale

    @staticmethod
    def build_decoder(config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> nn.Module:
        return Cohere2Model(config, max_position, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                metadata: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, metadata, backend)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Llama's logits times ``logit_scale``, in the model's dtype as Hugging Face's."""
        return super().compute_logits(hidden) * self.logit_scale

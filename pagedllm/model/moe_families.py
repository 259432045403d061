"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, Granite-MoE and gpt-oss.

Each is the dense decoder of ``llama.py`` (attention, norms, rope, the add-then-norm layer,
loading and the LM head) whose MLP is a ``moe.block.SparseMoeBlock`` on its sparse layers,
each as Hugging Face's modeling file computes it:
- Qwen3-MoE: Qwen3's attention (per-head q/k RMS norm); Qwen2-MoE: Qwen2's (q/k/v biases per
  ``qkv_bias``) and a shared expert behind a sigmoid gate; both take ``mlp_only_layers`` and
  ``decoder_sparse_step`` (their dense layers are ``intermediate_size`` wide, the experts
  ``moe_intermediate_size``);
- OLMoE: q and k RMS-normalised over the whole projection (all heads at once) before the rope;
- Mixtral: Mistral's attention;
- Granite-MoE: Granite's multipliers (embedding, residual, attention, logits);
- gpt-oss: attention sinks, q/k/v/o biases, its router's bias and its experts' biases and
  clamped SwiGLU (``gpt_oss``).
The routing of each is in ``moe.routers``. Tensor parallelism splits every expert's width
(``moe.sharding``). Refused: OLMoE's ``clip_qkv``, an activation other than SiLU (gpt-oss's
experts have their own), gpt-oss's MXFP4 safetensors.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.gpt_oss import GptOssRMSNorm, SinkAttention, check_gpt_oss_config, gpt_oss_expert_layout
from pagedllm.model.layers import Embedding, RMSNorm
from pagedllm.model.llama import Attention, DecoderLayer, LlamaForCausalLM, check_silu
from pagedllm.model.moe.block import SparseMoeBlock, expert_width_of, is_sparse_layer
from pagedllm.model.moe.names import stack_expert_weights
from pagedllm.model.moe.packed_experts import install_packed_experts
from pagedllm.model.moe.sharding import expert_widths, shard_expert_weights
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.shapes import head_dim_of, sliding_windows_of

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe", "gpt_oss")


class OlmoeAttention(Attention):
    """Llama's attention with OLMoE's q/k norms over the whole projection (not per head)."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TensorParallelGroup,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, rotary, tp, sliding_window)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)

    def position(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[0]
        q = self.q_norm(q.reshape(tokens, self.q_size)).view(tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(tokens, self.kv_size)).view(tokens, self.num_kv_heads, self.head_dim)
        return self.rotary(positions, q, k, metadata)


# The families whose attention is not Llama's (in ``llama.Attention``'s signature).
_ATTENTION: dict[str, type[Attention]] = {"olmoe": OlmoeAttention, "gpt_oss": SinkAttention}


class MoeDecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        attention = _ATTENTION.get(config.model_type, Attention)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, tp, attention=attention(config, rotary, tp, window))
                                    for window in sliding_windows_of(config))
        norm = GptOssRMSNorm if config.model_type == "gpt_oss" else RMSNorm
        for index, layer in enumerate(self.layers):
            if is_sparse_layer(config, index):
                layer.mlp = SparseMoeBlock(config, tp)
            if norm is not RMSNorm:
                layer.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
                layer.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


def check_moe_config(config: PretrainedConfig, tp: TensorParallelGroup) -> None:
    """ValueError naming what this slice of issue 57 does not run, or an expert width
    ``tp.world_size`` does not divide."""
    expert_widths(config, expert_width_of(config), tp)
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"clip_qkv={config.clip_qkv} (OLMoE's q/k/v clamp) is not supported; "
                         "only checkpoints with clip_qkv=None run")
    if config.model_type == "gpt_oss":
        check_gpt_oss_config(config)
    else:
        check_silu(config)


class MoeForCausalLM(LlamaForCausalLM):
    """The MoE families; loading is Llama's after the expert weights are stacked
    (``moe.names.stack_expert_weights``) or, from a GGUF, installed packed
    (``moe.packed_experts``), then cut to this rank's slices (``moe.sharding``)."""

    model_types = MOE_MODEL_TYPES

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        check_moe_config(config, tp)
        super().__init__(config, max_position, tp)

    @staticmethod
    def build_decoder(config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> nn.Module:
        return MoeDecoderModel(config, max_position, tp)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        if self.config.model_type == "gpt_oss":  # first: its GGUF biases go with packed experts
            gpt_oss_expert_layout(state_dict)
        install_packed_experts(self, state_dict)  # a GGUF's merged expert tensors
        stack_expert_weights(state_dict)
        shard_expert_weights(state_dict, self.tp)
        super().load_weights(state_dict)

"""Tiny configs of every MoE family (hidden 64, 8 experts, top-2, expert width 32) and a
random Hugging Face model of one, its routers scaled so that routing is far from uniform.

gpt-oss: layers sliding (window 8, shorter than most prompts), full, sliding; YaRN rope
(factor 4 over 256 positions); SwiGLU limit 0.2, so the clamps change its predictions; its
sinks drawn around 1 and its expert biases with spread 0.1, so both move the outputs."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

_COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, num_experts_per_tok=2, rms_norm_eps=1e-5)
_FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48,
                                                     head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48,
                                                     shared_expert_intermediate_size=40, decoder_sparse_step=1,
                                                     mlp_only_layers=[2])),
    "olmoe": (transformers.OlmoeConfig, dict(num_experts=8, intermediate_size=32)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=8, intermediate_size=32)),
    "granitemoe": (transformers.GraniteMoeConfig, dict(num_local_experts=8, intermediate_size=32,
                                                        embedding_multiplier=3.0, residual_multiplier=0.5,
                                                        attention_multiplier=0.2, logits_scaling=2.0)),
    "gpt_oss": (transformers.GptOssConfig, dict(num_local_experts=8, intermediate_size=32, head_dim=16,
                                                 sliding_window=8, swiglu_limit=0.2,
                                                 rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                                                      beta_slow=1.0, truncate=False,
                                                                      original_max_position_embeddings=256,
                                                                      rope_theta=150000.0))),
}
FAMILIES = tuple(_FAMILIES)


def moe_config(family: str, vocab_size: int, **overrides) -> PretrainedConfig:
    cls, options = _FAMILIES[family]
    config = cls(vocab_size=vocab_size, **{**_COMMON, **options, **overrides})
    config.eos_token_id = config.pad_token_id = config.bos_token_id = None
    return config


def routers_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The router weight [experts, hidden] of every sparse layer of a Hugging Face MoE model."""
    return [param for name, param in model.named_parameters()
            if name.endswith(("mlp.gate.weight", "router.weight")) and param.dim() == 2 and param.shape[0] == 8]


def random_moe_model(config: PretrainedConfig, router_scale: float = 30.0) -> torch.nn.Module:
    """A random fp32 model (seed 0) on eager attention and eager experts (Hugging Face's reference
    order); norm weights around 1, gpt-oss's sinks around 1 and its expert biases around 0 with
    spread 0.1, and routers ``router_scale`` times their init (0: all zero, every token ties on the
    same experts; a router's bias, gpt-oss's, is kept)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "sinks")):
                param.normal_(1.0, 0.3 if name.endswith("norm.weight") else 1.0)
            elif name.endswith("proj_bias"):
                param.normal_(0.0, 0.1)
        for router in routers_of(model):
            router.mul_(router_scale)
    return model.eval()

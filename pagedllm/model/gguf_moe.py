"""Mixture-of-experts GGUF files (llama.cpp's qwen3moe, qwen2moe, olmoe, granitemoe and gpt-oss
architectures, and Mixtral, which it writes as ``llama`` with ``llama.expert_count``): their
tensor names and the config fields their metadata gives.

llama.cpp's converter (convert_hf_to_gguf.py, ``Qwen2MoeModel`` / ``OlmoeModel``) stacks each
layer's experts into one tensor per projection, ``blk.N.ffn_{gate,up,down}_exps.weight``:
torch shapes [E, I, H] for gate and up, [E, H, I] for down (gguf-py lists them reversed);
``--fuse-gate-up-exps`` writes ``ffn_gate_up_exps`` [E, 2I, H] (gate rows first) instead.
The router is ``ffn_gate_inp`` [E, H]; Qwen2-MoE's shared expert is ``ffn_{gate,up,down}_shexp``
with its gate ``ffn_gate_inp_shexp`` ([H]: Hugging Face's [1, H]). The MoE architectures'
q/k rows are not permuted; Mixtral's and Granite-MoE's are, as every llama and granite file's
(``LlamaModel`` merges Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` into the same three
stacks; ``GraniteMoeModel`` splits Granite-MoE's ``input_linear`` into gate and up). Here the merged tensors load under
``mlp.experts.{gate,up,down,gate_up}_proj.weight``, then ``moe.packed_experts`` keeps
quantized ones packed or stacks them densely.

gpt-oss (``GptOssModel``): the router is ``ffn_gate_inp`` with a bias; the experts are
``ffn_{gate,up,down}_exps`` as above (gate and up de-interleaved from Hugging Face's
``gate_up_proj``, transposed to [E, I, H]; the hub's MXFP4 blocks are repacked as GGUF MXFP4,
bf16 ones written as they are) with biases ``ffn_{gate,up}_exps.bias`` [E, I] and
``ffn_down_exps.bias`` [E, H]; the sinks are ``attn_sinks.weight`` [heads]; the norm before the
MLP is ``post_attention_norm``; q/k are not permuted. Its metadata has ``attention.sliding_window``
and ``expert_feed_forward_length``; the alternation (even layers sliding) and the SwiGLU's
alpha 1.702 and limit 7.0 are hard-coded in llama.cpp, as they are Hugging Face's defaults. Its
YaRN is Hugging Face's gpt-oss config's (``truncate: false``, which the file does not store).

Routing is what llama.cpp hard-codes per architecture, which matches each Hugging Face
config's default: qwen3moe renormalises the top-k weights (``norm_topk_prob``), qwen2moe and
olmoe do not; Mixtral's routing always renormalises, Granite-MoE's is a softmax over the top k. A layer without ``ffn_gate_inp`` is a dense layer (``mlp_only_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# GGUF layer tensor -> Hugging Face module, for the MoE MLP.
MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# gpt-oss's layer tensors beyond those (its expert biases ride on the names above, ``.bias``).
GPT_OSS_TENSORS = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
MOE_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe"}
_RENORMALIZES = {"qwen3moe": True, "qwen2moe": False, "olmoe": False}


def moe_settings(arch_key: Callable[..., Any], architecture: str, shapes: dict[str, tuple[int, ...]],
                 settings: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a MoE architecture's metadata (empty for any other architecture)."""
    if architecture == "granitemoe" or moe_model_type(arch_key, architecture) == "mixtral":
        # num_local_experts, each intermediate_size (feed_forward_length) wide
        local = {"num_local_experts": arch_key("expert_count"), "num_experts_per_tok": arch_key("expert_used_count")}
        return {**local, "attention_bias": "blk.0.attn_q.bias" in shapes} if architecture == "granitemoe" else local
    if architecture == "gpt-oss":
        return {"num_local_experts": arch_key("expert_count"), "num_experts_per_tok": arch_key("expert_used_count"),
                "intermediate_size": arch_key("expert_feed_forward_length", settings["intermediate_size"]),
                "sliding_window": arch_key("attention.sliding_window")}
    if architecture not in MOE_ARCHITECTURES:
        return {}
    layers = settings["num_hidden_layers"]
    width = arch_key("expert_feed_forward_length", None)
    out: dict[str, Any] = {
        "num_experts": arch_key("expert_count"),
        "num_experts_per_tok": arch_key("expert_used_count"),
        "norm_topk_prob": _RENORMALIZES[architecture],
    }
    if architecture == "olmoe":  # OLMoE's intermediate_size is its experts' width
        out["intermediate_size"] = width or settings["intermediate_size"]
        out["attention_bias"] = "blk.0.attn_q.bias" in shapes
        return out
    out.update(moe_intermediate_size=width, decoder_sparse_step=1,
               mlp_only_layers=[n for n in range(layers) if f"blk.{n}.ffn_gate_inp.weight" not in shapes])
    if architecture == "qwen2moe":
        out["qkv_bias"] = "blk.0.attn_q.bias" in shapes
        out["shared_expert_intermediate_size"] = arch_key("expert_shared_feed_forward_length", 0)
    return out


def moe_model_type(arch_key: Callable[..., Any], architecture: str) -> str | None:
    """``mixtral`` for a llama file with experts (llama.cpp writes Mixtral as llama), else None."""
    return "mixtral" if architecture == "llama" and arch_key("expert_count", 0) else None


def shape_moe_tensor(name: str, weights: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared-expert gate as Hugging Face's [1, H] (llama.cpp stores [H])."""
    if name.endswith("mlp.shared_expert_gate.weight") and weights.dim() == 1:
        return weights.unsqueeze(0)
    return weights

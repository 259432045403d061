"""A tiny Hugging Face mixture of experts written as llama.cpp's converter writes it (merged
``ffn_{gate,up,down}_exps`` stacks, ``ffn_gate_inp`` routers, Qwen2-MoE's ``*_shexp``, Mixtral as
llama and Granite-MoE with permuted q/k, gpt-oss's de-interleaved gate/up with their biases,
``attn_sinks`` and ``post_attention_norm``), with
its expert stacks quantized to a chosen GGUF type by ``gguf.quants``; the model's expert
weights are then set to the dequantized values, so it is the oracle of the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from tests.model.test_loader import _gguf_name, _llama_cpp_permute, _write_gguf, add_decoder_metadata

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
             "granitemoe": "granitemoe", "gpt_oss": "gpt-oss"}
# gpt-oss's in-memory names (beyond test_loader's) -> its GGUF layer tensors.
_GPT_OSS_NAMES = {"self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                  "mlp.router.bias": "ffn_gate_inp.bias",
                  "post_attention_layernorm.weight": "post_attention_norm.weight",
                  "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}


def _metadata(writer: GGUFWriter, config) -> None:
    add_decoder_metadata(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if config.model_type == "granitemoe":  # its multipliers, as llama.cpp renames them
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if config.model_type == "gpt_oss":  # GptOssModel.set_gguf_parameters and its YaRN
        rope = config.rope_parameters
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _stack(writer: GGUFWriter, name: str, values: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Write one expert stack as ``qtype``; returns what the file decodes to (the oracle's weights)."""
    array = values.detach().numpy()
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(array))
        return values.detach()
    blocks = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, blocks, raw_dtype=qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).reshape(values.shape)


def _permuted(name: str, weights: np.ndarray, config) -> np.ndarray:
    """llama.cpp's q/k row permutation, which it applies to llama and granite files only."""
    if config.model_type not in ("mixtral", "granitemoe") or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return weights
    heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
    return _llama_cpp_permute(weights, heads)


def write_moe_gguf(path: Path, model: torch.nn.Module, expert_type: GGMLQuantizationType) -> Path:
    """Write ``model`` (a Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral or Granite-MoE) to ``path``, its expert stacks as
    ``expert_type``, everything else F32; the model's experts become the file's decoded values."""
    config = model.config

    def tensors(writer: GGUFWriter) -> None:
        _metadata(writer, config)
        for name, param in model.named_parameters():
            if config.model_type == "gpt_oss" and _gpt_oss_tensor(writer, name, param, expert_type):
                continue
            if name.endswith(".experts.gate_up_proj"):
                blk = f"blk.{name.split('.')[2]}"
                gate, up = param.chunk(2, dim=1)
                decoded = [_stack(writer, f"{blk}.ffn_{part}_exps.weight", values, expert_type)
                           for part, values in (("gate", gate), ("up", up))]
                param.data = torch.cat(decoded, dim=1)
            elif name.endswith(".experts.down_proj"):
                blk = f"blk.{name.split('.')[2]}"
                param.data = _stack(writer, f"{blk}.ffn_down_exps.weight", param, expert_type)
            else:
                # Granite-MoE's in-memory names: block_sparse_moe.router is the router (mlp.gate)
                plain = name.replace("block_sparse_moe.router", "mlp.gate").replace("block_sparse_moe", "mlp")
                writer.add_tensor(_gguf_name(plain), _permuted(name, param.detach().numpy(), config))

    model.generation_config.eos_token_id = 2  # the file's EOS: masked by min_new_tokens in both
    return _write_gguf(path, GGUF_ARCH[config.model_type], extra=tensors)


def _gpt_oss_tensor(writer: GGUFWriter, name: str, param: torch.nn.Parameter,
                    expert_type: GGMLQuantizationType) -> bool:
    """Write one of gpt-oss's own tensors as ``GptOssModel.modify_tensors`` does (False: a tensor
    the other families share). ``gate_up_proj`` [E, H, 2I] (columns gate, up, gate, ...) becomes
    ``ffn_gate_exps`` and ``ffn_up_exps`` [E, I, H], ``down_proj`` [E, I, H] ``ffn_down_exps`` [E, H, I]."""
    if not name.startswith("model.layers."):
        return False
    _, _, layer, part = name.split(".", 3)
    blk = f"blk.{layer}"
    if part == "mlp.experts.gate_up_proj":
        decoded = [_stack(writer, f"{blk}.ffn_{kind}_exps.weight", param[..., start::2].transpose(1, 2).contiguous(),
                          expert_type) for start, kind in ((0, "gate"), (1, "up"))]
        param.data = torch.stack(decoded, dim=-1).transpose(1, 2).flatten(2).contiguous()  # re-interleaved
    elif part == "mlp.experts.down_proj":
        param.data = _stack(writer, f"{blk}.ffn_down_exps.weight", param.transpose(1, 2).contiguous(),
                            expert_type).transpose(1, 2)
    elif part == "mlp.experts.gate_up_proj_bias":
        for start, kind in ((0, "gate"), (1, "up")):
            bias = np.ascontiguousarray(param.detach()[..., start::2].numpy())
            writer.add_tensor(f"{blk}.ffn_{kind}_exps.bias", bias)
    elif part in _GPT_OSS_NAMES:
        writer.add_tensor(f"{blk}.{_GPT_OSS_NAMES[part]}", param.detach().numpy())
    else:
        return False
    return True

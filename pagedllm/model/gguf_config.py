"""What each llama.cpp GGUF architecture looks like (tensor names, layout, rope tensors), and the
transformers config built from a file's metadata.

Per-architecture rules live in ``GGUF_ARCHITECTURES``; an architecture not listed there does not
load. Rope scaling that llama.cpp stores as tensors rather than metadata becomes part of the config:
``rope_freqs`` (Llama 3.1+: per-dimension divisors of the inverse frequencies) as
``config.gguf_rope_factors``, Phi-3's ``rope_factors_long``/``rope_factors_short`` as its longrope
``long_factor``/``short_factor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from pagedllm.model.gguf_moe import GPT_OSS_TENSORS, MOE_ARCHITECTURES, MOE_TENSORS, moe_model_type, moe_settings
from pagedllm.model.gguf_reader import GGUFArray, GGUFFile

_REQUIRED = object()  # marks a metadata key that has no default

# GGUF layer tensor names (llama.cpp) -> Hugging Face module names, without the .weight/.bias suffix.
_SEPARATE_PROJECTIONS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3 keeps Hugging Face's fused projections: attn_qkv is q|k|v, ffn_up is gate|up.
_FUSED_PROJECTIONS = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3 normalise each sublayer's output as well, so their ffn_norm is the norm before the MLP,
# not Llama's post_attention_layernorm.
_SANDWICH_NORMS = {
    **_SEPARATE_PROJECTIONS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Optional Gemma metadata "<arch>.<key>" -> config field (absent: the config's default, which for
# these is llama.cpp's too: Gemma 2 caps 50/30 and alternates windows, Gemma 3 has a full layer
# every 6).
_GEMMA2_KEYS = {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping"}
_GEMMA3_KEYS = {"attention.sliding_window": "sliding_window"}
# llama.cpp's converter renames Granite's multipliers to *_scale and writes each only when set.
_GRANITE_KEYS = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                 "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
# llama.cpp's block counts of the 27B Gemmas, which scale queries by (hidden / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GGUFArchitecture:
    layer_names: dict[str, str]  # GGUF layer tensor -> Hugging Face module
    unpermute_qk: bool  # llama.cpp reorders llama's q/k rows to its interleaved rope layout
    rope_tensors: frozenset[str]  # global tensors that hold rope scaling: they go into the config
    partial_rotary: bool  # rope.dimension_count < head_dim maps to partial_rotary_factor
    # llama.cpp's Gemma converters store every RMSNorm weight w (Gemma scales by 1 + w) as 1 + w;
    # the loader subtracts the 1 again, in fp32, as transformers' GGUF loader does.
    norms_stored_plus_one: bool = False
    model_type: str | None = None  # the Hugging Face model_type where it differs (GGUF gemma3: gemma3_text)
    scalars: dict[str, str] = field(default_factory=dict)  # optional `{arch}.` metadata -> config attribute


_NO_ROPE_TENSORS: frozenset[str] = frozenset()
GGUF_ARCHITECTURES = {
    # Mixtral is written as llama with experts (gguf_moe): the MoE names are there for it.
    "llama": GGUFArchitecture({**_SEPARATE_PROJECTIONS, **MOE_TENSORS}, True, frozenset({"rope_freqs"}), False),
    "qwen2": GGUFArchitecture(_SEPARATE_PROJECTIONS, False, _NO_ROPE_TENSORS, False),
    "qwen3": GGUFArchitecture(_SEPARATE_PROJECTIONS, False, _NO_ROPE_TENSORS, False),
    "phi3": GGUFArchitecture(_FUSED_PROJECTIONS, False, frozenset({"rope_factors_long", "rope_factors_short"}), True),
    "gemma": GGUFArchitecture(_SEPARATE_PROJECTIONS, False, _NO_ROPE_TENSORS, False, norms_stored_plus_one=True),
    "gemma2": GGUFArchitecture(_SANDWICH_NORMS, False, _NO_ROPE_TENSORS, False, norms_stored_plus_one=True,
                               scalars=_GEMMA2_KEYS),
    "gemma3": GGUFArchitecture(_SANDWICH_NORMS, False, _NO_ROPE_TENSORS, False, norms_stored_plus_one=True,
                               model_type="gemma3_text", scalars=_GEMMA3_KEYS),
    # llama.cpp writes no NoPE layout for SmolLM3: it fixes every 4th layer (SmolLM3Config's default).
    "smollm3": GGUFArchitecture(_SEPARATE_PROJECTIONS, True, frozenset({"rope_freqs"}), False),
    "granite": GGUFArchitecture(_SEPARATE_PROJECTIONS, True, frozenset({"rope_freqs"}), False, scalars=_GRANITE_KEYS),
    "granitemoe": GGUFArchitecture({**_SEPARATE_PROJECTIONS, **MOE_TENSORS}, True, frozenset({"rope_freqs"}), False,
                                   scalars=_GRANITE_KEYS),
    # Mixtures of experts (gguf_moe): the dense names plus the router, experts and shared expert.
    **{name: GGUFArchitecture({**_SEPARATE_PROJECTIONS, **MOE_TENSORS}, False, _NO_ROPE_TENSORS, False,
                              model_type=model_type) for name, model_type in MOE_ARCHITECTURES.items()},
    "gpt-oss": GGUFArchitecture({**_SEPARATE_PROJECTIONS, **MOE_TENSORS, **GPT_OSS_TENSORS}, False, _NO_ROPE_TENSORS,
                                False, model_type="gpt_oss"),
}


def gguf_architecture(architecture: str) -> GGUFArchitecture:
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return GGUF_ARCHITECTURES[architecture]


def metadata(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    """A scalar or string metadata value; `default` when absent (absent and no default: ValueError)."""
    if key not in reader.metadata:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    value = reader.metadata[key]
    if isinstance(value, GGUFArray):  # e.g. per-layer head counts, which no supported model has
        raise ValueError(f"GGUF metadata {key!r} is an array; expected a single value")
    return value


def gguf_config(reader: GGUFFile, architecture: str, rope_tensors: dict[str, torch.Tensor]) -> PretrainedConfig:
    """Build the transformers config from GGUF metadata and the file's rope tensors (fp32, 1-D).

    Built here rather than by `AutoConfig.from_pretrained(..., gguf_file=...)`: that path ignores
    `attention.key_length`, so Qwen3 models whose head_dim is not hidden_size / heads come out wrong,
    and it re-reads the whole file slowly.
    """

    def arch_key(name: str, default: Any = _REQUIRED) -> Any:
        return metadata(reader, f"{architecture}.{name}", default)

    shapes = {tensor.name: tuple(int(size) for size in reversed(tensor.shape)) for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    heads = arch_key("attention.head_count")
    hidden_size = arch_key("embedding_length")
    head_dim = arch_key("attention.key_length", hidden_size // heads)
    settings: dict[str, Any] = {
        # the embedding's row count is what the state dict holds; the tokenizer may list fewer tokens
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden_size,
        "intermediate_size": arch_key("feed_forward_length"),
        "num_hidden_layers": arch_key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": arch_key("attention.head_count_kv", heads),
        "max_position_embeddings": arch_key("context_length"),
        "rms_norm_eps": arch_key("attention.layer_norm_rms_epsilon"),
        "rope_theta": arch_key("rope.freq_base", 10000.0),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id", None),
    }
    if architecture in ("llama", "qwen3", "qwen3moe", "granite", "smollm3", "gemma", "gemma2", "gemma3", "gpt-oss"):
        # Qwen2Config has neither: head_dim is implied, biases always on
        settings["head_dim"] = head_dim
        settings["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if architecture in ("llama", "granite", "smollm3"):
        settings["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    for key, attribute in gguf_architecture(architecture).scalars.items():
        if (value := arch_key(key, None)) is not None:
            settings[attribute] = value
    settings.update(_gemma_query_scale(architecture, settings))
    settings.update(moe_settings(arch_key, architecture, shapes, settings))
    if architecture == "phi3":
        settings["original_max_position_embeddings"] = arch_key("rope.scaling.original_context_length",
                                                                settings["max_position_embeddings"])
        settings["sliding_window"] = arch_key("attention.sliding_window", 0) or None  # 0: none (Phi-4)
    settings.update(_rope_settings(arch_key, architecture, head_dim, settings, rope_tensors))
    model_type = moe_model_type(arch_key, architecture) or gguf_architecture(architecture).model_type
    config = AutoConfig.for_model(model_type or architecture, **settings)
    if "rope_freqs" in rope_tensors:
        config.gguf_rope_factors = rope_tensors["rope_freqs"].tolist()
    return config


def _gemma_query_scale(architecture: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's query scale, which llama.cpp derives from the model size instead of storing it."""
    if architecture not in _GEMMA_27B_LAYERS:
        return {}
    is_27b = settings["num_hidden_layers"] == _GEMMA_27B_LAYERS[architecture]
    return {"query_pre_attn_scalar": settings["hidden_size"] // settings["num_attention_heads"] if is_27b
            else settings["head_dim"]}


def _rope_settings(arch_key, architecture: str, head_dim: int, settings: dict[str, Any],
                   rope_tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Config entries for the rope: partial rotary, scaling from metadata (linear, yarn) or from
    Phi-3's long/short factor tensors (longrope)."""
    out: dict[str, Any] = {}
    rope_dim = arch_key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        if not gguf_architecture(architecture).partial_rotary:
            raise ValueError(f"GGUF rope.dimension_count {rope_dim} differs from head_dim {head_dim} "
                             f"(partial rotary), which {architecture!r} does not support; phi3 does")
        out["partial_rotary_factor"] = rope_dim / head_dim
    scaling = arch_key("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        out["rope_scaling"] = {"rope_type": scaling, "factor": arch_key("rope.scaling.factor")}
        if scaling == "yarn":
            out["rope_scaling"].update(_yarn(arch_key, architecture))
    elif scaling == "none" and architecture == "gpt-oss":  # GptOssConfig's default rope is YaRN
        out["rope_scaling"] = {"rope_type": "default"}
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported; supported: linear, yarn")
    if "rope_factors_long" in rope_tensors or "rope_factors_short" in rope_tensors:
        out["rope_scaling"] = _longrope(arch_key, settings, rope_tensors)
    return out


def _yarn(arch_key, architecture: str) -> dict[str, Any]:
    """YaRN's parameters beyond its factor: the original window, the betas where the file has them,
    and gpt-oss's ``truncate: false`` (its Hugging Face config's; llama.cpp does not store it)."""
    out: dict[str, Any] = {"original_max_position_embeddings": arch_key("rope.scaling.original_context_length")}
    for key in ("beta_fast", "beta_slow"):
        if (value := arch_key(f"rope.scaling.yarn_{key}", None)) is not None:
            out[key] = value
    if architecture == "gpt-oss":
        out["truncate"] = False
    return out


def _longrope(arch_key, settings: dict[str, Any], rope_tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Phi-3's longrope parameters. The attention factor is left for transformers to derive from
    the window ratio (as in the Hugging Face config) unless the file's differs from that."""
    if not {"rope_factors_long", "rope_factors_short"} <= set(rope_tensors):
        raise ValueError("GGUF file has only one of rope_factors_long / rope_factors_short; longrope needs both")
    original = settings["original_max_position_embeddings"]
    params: dict[str, Any] = {"rope_type": "longrope", "long_factor": rope_tensors["rope_factors_long"].tolist(),
                              "short_factor": rope_tensors["rope_factors_short"].tolist()}
    scale = settings["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    stored = arch_key("rope.scaling.attn_factor", derived)
    if not math.isclose(stored, derived, rel_tol=1e-6):
        params["attention_factor"] = stored
    return params

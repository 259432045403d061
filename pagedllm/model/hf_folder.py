"""Hugging Face ``save_pretrained`` folders: config.json, tokenizer files, ``*.safetensors`` (one
file, or shards listed in ``model.safetensors.index.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from pagedllm.model.checkpoint import WHAT_TO_PASS, Checkpoint, check_architecture
from pagedllm.model.gpt_oss import fp32_norm_weights
from pagedllm.model.registry import model_class_for
from pagedllm.model.safetensors_reader import read_safetensors
from pagedllm.model.shapes import classifier_labels_of
from pagedllm.model.vision.config import decoder_config_of

# Files any one of which lets AutoTokenizer build a tokenizer from a folder.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_hf_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    """Load a `save_pretrained` folder. All file checks run before any tensor is read."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(folder)!r} has no config.json; {WHAT_TO_PASS}")
    # Read model_type ourselves: AutoConfig fails with its own, less helpful error on unknown types.
    check_architecture(json.loads(config_file.read_text()).get("model_type"))
    shards = safetensors_shards(folder)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{str(folder)!r} has no tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")

    config = decoder_config_of(AutoConfig.from_pretrained(folder, local_files_only=True))
    model_class_for(config)  # a vision-language checkpoint's decoder too, before any tensor is read
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        # Old checkpoints saved the rotary frequencies; they are recomputed from the config.
        state_dict.update(read_safetensors(shard, dtype, skip=lambda name: name.endswith("rotary_emb.inv_freq"),
                                           keep_fp32=fp32_norm_weights(config, dtype)))
    if classifier_labels_of(config) is not None:
        if "score.weight" not in state_dict:
            raise ValueError(f"{str(folder)!r} is a sequence classifier without score.weight")
    elif config.tie_word_embeddings:
        # Some checkpoints store the tied copy anyway; transformers ignores it, and so do we.
        state_dict.pop("lm_head.weight", None)
    elif not any(name in state_dict for name in ("lm_head.weight", "language_model.lm_head.weight")):
        # (The second: LLaVA's saved layout, renamed by its family class on loading.)
        raise ValueError(f"{str(folder)!r} has no lm_head.weight and its config does not tie word embeddings")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Checkpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, path=str(folder))


def safetensors_shards(folder: Path) -> list[Path]:
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
        raise ValueError(f"{str(folder)!r} has no *.safetensors weight files; {WHAT_TO_PASS}")
    return shards



"""Encoder-only checkpoints: which architectures run, and loading one from a Hugging Face folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoConfig, PretrainedConfig

from pagedllm.model.bert import BertEncoder, PackedBatch, TanhClassifierHead, strip_prefix
from pagedllm.model.hf_folder import safetensors_shards
from pagedllm.model.modernbert import ModernBertClassifierHead, ModernBertEncoder
from pagedllm.model.safetensors_reader import read_safetensors

# config.json architecture -> (family, has a sequence-classification head).
ENCODER_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "BertModel": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "RobertaModel": ("roberta", False),
    "RobertaForSequenceClassification": ("roberta", True),
    "XLMRobertaModel": ("roberta", False),
    "XLMRobertaForSequenceClassification": ("roberta", True),
    "ModernBertModel": ("modernbert", False),
    "ModernBertForSequenceClassification": ("modernbert", True),
}
# Where each family's classifier checkpoints keep the encoder, and a weight that must be there.
_PREFIXES = {"bert": ("", "bert."), "roberta": ("", "roberta."), "modernbert": ("", "model.")}
_PROBES = {"bert": "embeddings.word_embeddings.weight", "roberta": "embeddings.word_embeddings.weight",
           "modernbert": "embeddings.tok_embeddings.weight"}


class Encoder(Protocol):
    hidden_size: int
    max_len: int
    num_token_types: int | None  # None: token_type_ids are ignored

    def forward(self, batch: PackedBatch) -> torch.Tensor: ...


class ClassifierHead(Protocol):
    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor: ...


@dataclass
class EncoderModel:
    config: PretrainedConfig
    encoder: Encoder
    head: ClassifierHead | None  # None: a base model (embeddings only)


def encoder_architecture(folder: Path) -> str | None:
    """The folder's config.json architecture when it is an encoder this package runs, else None."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    return architectures[0] if architectures and architectures[0] in ENCODER_ARCHITECTURES else None


def load_encoder(folder: Path, dtype: torch.dtype) -> EncoderModel:
    """Load an encoder checkpoint folder (config.json + *.safetensors)."""
    architecture = encoder_architecture(folder)
    if architecture is None:
        raise ValueError(f"{str(folder)!r} is not an encoder checkpoint; its config.json architecture must be "
                         f"one of {', '.join(ENCODER_ARCHITECTURES)}")
    family, classifier = ENCODER_ARCHITECTURES[architecture]
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    weights: dict[str, torch.Tensor] = {}
    for shard in safetensors_shards(folder):
        weights.update(read_safetensors(shard, dtype, skip=lambda name: name.endswith("position_ids")))
    weights = strip_prefix(weights, _PROBES[family], _PREFIXES[family])
    encoder: Encoder
    if family == "modernbert":
        encoder = ModernBertEncoder(config, weights)
        head = ModernBertClassifierHead(config, weights) if classifier else None
    else:
        encoder = BertEncoder(config, weights, roberta=family == "roberta")
        head = TanhClassifierHead(weights, family) if classifier else None
    return EncoderModel(config=config, encoder=encoder, head=head)

"""Fixtures for the encoder tests: the real all-MiniLM-L6-v2 folder, tiny random encoders, real text.

The real folder is ``tests/conftest.py``'s ``minilm_folder``. Tiny models are made by transformers, saved with
``save_pretrained`` and given MiniLM's WordPiece tokenizer.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
# MiniLM's tokenizer files, copied into every tiny model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=160, initializer_range=0.2)


def real_texts(count: int) -> list[str]:
    """English sentences and multi-sentence passages from the repo's docs: 1 to ~250 tokens."""
    text = " ".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    text = re.sub(r"[`#|*\[\]()]+", " ", text)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 3 < len(s.strip()) < 400]
    texts = ["Retrieval.", "KV"]  # one-word inputs: [CLS] word [SEP]
    for i in range(count):
        # Every fourth input is a passage of 1 to 12 sentences, the rest single sentences.
        texts.append(" ".join(sentences[i * 7:i * 7 + 1 + i % 12]) if i % 4 == 0 else sentences[i * 3 + 1])
    return texts[:count]


def _tiny_config(family: str, **extra):
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig

    if family == "bert":
        return BertConfig(**TINY, **extra)
    if family == "xlm-roberta":
        return XLMRobertaConfig(**TINY, **extra)
    # Token ids in MiniLM's vocabulary; a small local window so inputs cross it.
    return ModernBertConfig(**TINY, pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101,
                            sep_token_id=102, local_attention=16, **extra)


def save_tiny(folder: Path, minilm: Path, family: str, classifier: bool = False, **extra) -> torch.nn.Module:
    """A tiny random ``*Model`` (or ``*ForSequenceClassification``) of ``family`` saved to ``folder``."""
    import transformers

    prefix = {"bert": "Bert", "xlm-roberta": "XLMRoberta", "modernbert": "ModernBert"}[family]
    model_class = getattr(transformers, prefix + ("ForSequenceClassification" if classifier else "Model"))
    torch.manual_seed(0)
    model = model_class(_tiny_config(family, **extra)).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, folder / name)
    return model


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))

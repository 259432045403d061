"""Attention shapes read from a Hugging Face model config (no torch import).

Checkpoints leave fields out: ``head_dim`` defaults to hidden_size / heads and
``num_key_value_heads`` to the number of query heads (plain multi-head
attention). Every reader goes through these two so the defaults live here.
"""

from __future__ import annotations

from typing import Any


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

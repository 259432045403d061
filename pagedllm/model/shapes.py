"""Attention shapes and per-layer windows read from a Hugging Face model config (no torch import).

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


def sliding_windows_of(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as Hugging Face applies it:
    ``config.layer_types`` marks the sliding layers when the config has it (Qwen2,
    Gemma 2/3); otherwise a ``sliding_window`` applies to every layer (Mistral)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]

"""Attention shapes and per-layer windows read from a Hugging Face model config (no torch import).

Checkpoints leave fields out: ``head_dim`` defaults to hidden_size / heads and
``num_key_value_heads`` to the number of query heads (plain multi-head
attention). Every reader goes through these two so the defaults live here.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.kv_managers.chunked_local import ChunkedLocal
from pagedllm.core.kv_managers.kinds import LayerAttention


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def classifier_labels_of(config: Any) -> int | None:
    """The labels of a ``*ForSequenceClassification`` checkpoint (its ``score``
    head's rows, in place of an LM head); None for a causal LM."""
    architectures = getattr(config, "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        return None
    return int(config.num_labels)


# What each family's Hugging Face modeling code does with a config's window (checked against
# the attention masks it builds, tests/model/test_layer_windows.py):
# no window at all, whatever the config carries (a fine-tune's config may keep a stray one);
_NO_WINDOW_TYPES = frozenset({"llama", "granite", "gemma", "olmoe", "granitemoe"})
# one window on every layer: one mask for the whole model, ``layer_types`` is not read;
_EVERY_LAYER_TYPES = frozenset({"mistral", "phi3", "mixtral", "qwen3_moe"})
# a window only with ``use_sliding_window`` on: their configs carry one regardless (Qwen2.5's 32k).
_OPT_IN_TYPES = frozenset({"qwen2", "qwen3", "smollm3", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"})


def sliding_windows_of(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as Hugging Face's modeling code
    applies it: none for Llama, Granite and Gemma 1; ``sliding_window`` on every layer for
    Mistral and Phi-3; otherwise (Gemma 2/3, Cohere 2, and Qwen2/3 and SmolLM3 with
    ``use_sliding_window``) on the layers ``config.layer_types`` marks as sliding, which
    transformers builds from the older fields (Gemma 2 alternating from layer 0, Gemma 3's and
    Cohere 2's ``sliding_window_pattern``, Qwen2's layers from ``max_window_layers`` on). A query at
    position p sees keys p - window < j <= p."""
    num_layers = config.num_hidden_layers
    model_type = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    if window is None or model_type in _NO_WINDOW_TYPES \
            or (model_type in _OPT_IN_TYPES and not getattr(config, "use_sliding_window", False)):
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or model_type in _EVERY_LAYER_TYPES:
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def attention_chunks_of(config: Any) -> list[int | None]:
    """Each layer's attention chunk (None: none): Llama 4's ``attention_chunk_size`` on the
    layers ``config.layer_types`` marks ``chunked_attention`` (a query at p reads keys from
    p // chunk * chunk), as Hugging Face's chunked causal mask applies it."""
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None) or []
    if chunk is None or "chunked_attention" not in layer_types:
        return [None] * config.num_hidden_layers
    return [chunk if kind == "chunked_attention" else None for kind in layer_types]


def layer_attention_of(config: Any) -> list[LayerAttention]:
    """Each layer's attention as the KV cache groups take it (``core.kv_groups``): its
    sliding window (``sliding_windows_of``), a ``ChunkedLocal`` chunk, or None (full)."""
    chunks = attention_chunks_of(config)
    return [ChunkedLocal(chunk) if chunk is not None else window
            for chunk, window in zip(chunks, sliding_windows_of(config))]

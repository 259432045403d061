"""The attention kinds a KV cache group can have, and the per-layer spelling of each (no torch).

A model states each layer's attention as None (full attention), an integer ``W`` (a
sliding window of ``W`` tokens, ``model.shapes.sliding_windows_of``) or a kind object
(``ChunkedLocal(C)``, Llama 4's ``chunked_attention`` layers); ``attention_of`` turns
either spelling into the kind whose rules the group's manager and the prefix cache follow.
"""

from __future__ import annotations

from pagedllm.core.kv_managers.chunked_local import ChunkedLocal
from pagedllm.core.kv_managers.full_attention import FullAttention
from pagedllm.core.kv_managers.sliding_window import SlidingWindow

AttentionKind = FullAttention | SlidingWindow | ChunkedLocal
# How a layer's attention is written: None, a window, or a kind.
LayerAttention = int | None | AttentionKind


def attention_of(layer: LayerAttention) -> AttentionKind:
    """The kind a layer's attention spelling names; ValueError for anything else."""
    if layer is None:
        return FullAttention()
    if isinstance(layer, (FullAttention, SlidingWindow, ChunkedLocal)):
        return layer
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"a layer's attention is None (full), a window (int) or a kind, got {layer!r}")
    return SlidingWindow(layer)

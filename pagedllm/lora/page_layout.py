"""Where an adapter's weights sit in the KV pool's blocks (pure integers, no torch).

Unified paging (S-LoRA's idea on this engine's pool): an adapter takes a run of
``num_pages`` consecutive block ids. In every layer, the key tensor's rows of
those blocks hold that layer's ``A`` matrices one after another, and the value
tensor's rows hold its ``B`` matrices (scaling folded in). Because a layer's
key (or value) tensor is block-major and contiguous, consecutive block ids are
one contiguous stretch of memory in each layer, so the product reads the
weights in place with no gather; and since every layer's blocks are laid out
alike, one set of offsets serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.lora.weights import LORA_MODULES
from pagedllm.model.shapes import head_dim_of, num_kv_heads_of
from pagedllm.utils import cdiv

# Each matrix starts on a 64-byte line (16 fp32 values) so the kernel's vector loads are aligned.
_ALIGN = 16


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable projection of a Llama-family config."""
    hidden, head_dim = config.hidden_size, head_dim_of(config)
    q_out, kv_out = config.num_attention_heads * head_dim, num_kv_heads_of(config) * head_dim
    inter = config.intermediate_size
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class AdapterLayout:
    """Element offsets, within a layer's key (``a_offsets``) and value (``b_offsets``)
    stretch of the adapter's first block, of each targeted module's A and B."""

    rank: int
    num_pages: int
    a_offsets: dict[str, int]
    b_offsets: dict[str, int]


def _align(offset: int) -> int:
    return cdiv(offset, _ALIGN) * _ALIGN


def adapter_layout(rank: int, targets: tuple[str, ...], shapes: dict[str, tuple[int, int]],
                   page_elems: int) -> AdapterLayout:
    """The layout of a rank-``rank`` adapter on ``targets`` when one block's key (and value)
    rows of one layer hold ``page_elems`` values of the model's dtype."""
    a_offsets: dict[str, int] = {}
    b_offsets: dict[str, int] = {}
    a_end = b_end = 0
    for module in LORA_MODULES:
        if module not in targets:
            continue
        in_features, out_features = shapes[module]
        a_offsets[module], a_end = a_end, _align(a_end + rank * in_features)
        b_offsets[module], b_end = b_end, _align(b_end + out_features * rank)
    return AdapterLayout(rank, max(1, cdiv(max(a_end, b_end), page_elems)), a_offsets, b_offsets)


def page_elems_of(key_pool: Any, dtype: Any) -> int:
    """Values of ``dtype`` one block's key rows of one layer hold (a page's size), from a
    layer's key tensor ``[num_blocks, ...]`` (any storage dtype: int8 pools hold fewer)."""
    return key_pool[0].numel() * key_pool.element_size() // dtype.itemsize

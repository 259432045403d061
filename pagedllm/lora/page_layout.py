"""Where an adapter's weights sit in the KV pool's blocks (pure integers, no torch).

Unified paging (S-LoRA's idea on this engine's pool): an adapter takes a run of
``num_pages`` consecutive block ids. In every layer, the key tensor's rows of
those blocks hold that layer's ``A`` matrices one after another, and the value
tensor's rows hold its ``B`` matrices (scaling folded in). Because a layer's
key (or value) tensor is block-major and contiguous, consecutive block ids are
one contiguous stretch of memory in each layer, so the product reads the
weights in place with no gather; and since every layer's blocks are laid out
alike, one set of offsets serves every layer.

With a hybrid KV layout (``core.kv_groups``: ``num_groups`` > 1), layers of
different groups share one slot tensor (``worker.block_moves.layer_caches``), so
they cannot all keep their weights in the same blocks: the run is ``num_groups``
stretches of ``num_pages`` pages, and a layer of group ``g`` keeps its A and B
in stretch ``g`` (``AdapterLayout.page_start``), where no other layer of its
slot tensor writes. This module is the one place that knows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.lora.weights import LORA_MODULES
from pagedllm.model.shapes import head_dim_of
from pagedllm.model.sharding import shard_layout
from pagedllm.utils import cdiv

# Each matrix starts on a 64-byte line (16 fp32 values) so the kernel's vector loads are aligned.
_ALIGN = 16


def projection_shapes(config: Any, tp: TensorParallelGroup = SINGLE) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable projection of a Llama-family config,
    as rank ``tp.rank`` holds it (``model.sharding``: q/k/v and gate/up split by output rows,
    o and down by input columns; the whole projection with one rank)."""
    layout = shard_layout(config, tp)
    hidden, head_dim = config.hidden_size, head_dim_of(config)
    q_out, kv_out = layout.num_heads * head_dim, layout.num_kv_heads * head_dim
    inter = layout.intermediate_size
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class AdapterLayout:
    """Element offsets, within a layer's key (``a_offsets``) and value (``b_offsets``)
    rows from its group's first page on (``page_start``), of each targeted module's A
    and B. ``num_pages``: one group's stretch; the run is ``num_blocks`` pages."""

    rank: int
    num_pages: int
    a_offsets: dict[str, int]
    b_offsets: dict[str, int]
    num_groups: int = 1

    @property
    def num_blocks(self) -> int:
        """Consecutive block ids the adapter takes: one stretch per KV cache group."""
        return self.num_groups * self.num_pages

    def page_start(self, first_block: int, group: int, page_elems: int) -> int:
        """Element offset, in the flat key (or value) tensor of a layer of KV cache group
        ``group``, of that layer's weights in the run that starts at ``first_block``."""
        return (first_block + group * self.num_pages) * page_elems


def _align(offset: int) -> int:
    return cdiv(offset, _ALIGN) * _ALIGN


def adapter_layout(rank: int, targets: tuple[str, ...], shapes: dict[str, tuple[int, int]],
                   page_elems: int, num_groups: int = 1) -> AdapterLayout:
    """The layout of a rank-``rank`` adapter on ``targets`` when one block's key (and value)
    rows of one layer hold ``page_elems`` values of the model's dtype, in a pool of
    ``num_groups`` KV cache groups."""
    a_offsets: dict[str, int] = {}
    b_offsets: dict[str, int] = {}
    a_end = b_end = 0
    for module in LORA_MODULES:
        if module not in targets:
            continue
        in_features, out_features = shapes[module]
        a_offsets[module], a_end = a_end, _align(a_end + rank * in_features)
        b_offsets[module], b_end = b_end, _align(b_end + out_features * rank)
    return AdapterLayout(rank, max(1, cdiv(max(a_end, b_end), page_elems)), a_offsets, b_offsets, num_groups)


def pages_on_every_rank(rank: int, targets: tuple[str, ...], config: Any, world_size: int,
                        rank0_page_elems: int, num_groups: int = 1) -> int:
    """The pages an adapter takes (its run, every group's stretch): the most any
    tensor-parallel rank needs for its shard. A rank's page holds its KV heads' share
    (``rank0_page_elems`` scaled by its KV heads over rank 0's), and its shard of the
    adapter follows its share of the projections."""
    heads0 = shard_layout(config, TensorParallelGroup(0, world_size)).num_kv_heads
    pages = 0
    for index in range(world_size):
        group = TensorParallelGroup(index, world_size)
        page_elems = rank0_page_elems * shard_layout(config, group).num_kv_heads // heads0
        layout = adapter_layout(rank, targets, projection_shapes(config, group), page_elems, num_groups)
        pages = max(pages, layout.num_blocks)
    return pages


def page_elems_of(key_pool: Any, dtype: Any) -> int:
    """Values of ``dtype`` one block's key rows of one layer hold (a page's size), from a
    layer's key tensor ``[num_blocks, ...]`` (any storage dtype: int8 pools hold fewer)."""
    return key_pool[0].numel() * key_pool.element_size() // dtype.itemsize

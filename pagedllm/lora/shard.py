"""One tensor-parallel rank's share of an adapter, cut as the base projections are cut."""

from __future__ import annotations

from typing import Any

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.lora.weights import LoRAWeights
from pagedllm.model.sharding import shard_layout

# Column-parallel projections keep A whole and split B's output rows; row-parallel ones split
# A's input columns and keep B whole: each rank's product is then its slice of the output
# (column) or a partial sum the projection's all-reduce completes (row), as for the base.
_COLUMN = {"q_proj": "q_rows", "k_proj": "kv_rows", "v_proj": "kv_rows", "gate_proj": "mlp_rows",
           "up_proj": "mlp_rows"}
_ROW = {"o_proj": "q_rows", "down_proj": "mlp_rows"}


def shard_weights(weights: LoRAWeights, config: Any, tp: TensorParallelGroup) -> LoRAWeights:
    """``weights`` as rank ``tp.rank`` multiplies them (the weights themselves with one rank)."""
    if tp.world_size == 1:
        return weights
    layout = shard_layout(config, tp)
    tensors = {}
    for (layer, module), (a, b) in weights.tensors.items():
        if module in _COLUMN:
            tensors[layer, module] = (a, b[getattr(layout, _COLUMN[module])].contiguous())
        else:
            tensors[layer, module] = (a[:, getattr(layout, _ROW[module])].contiguous(), b)
    return LoRAWeights(weights.rank, weights.scaling, tensors)

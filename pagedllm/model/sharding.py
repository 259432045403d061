"""Slicing a Hugging Face-named state dict into one rank's shard (Megatron style).

Column-parallel (output rows split, no communication): q/k/v projections by
KV-head groups (a rank takes whole KV heads and the query heads that read
them), gate/up by MLP columns. Row-parallel (input columns split, partial sums
all-reduced after): o_proj and down_proj; their biases are kept on rank 0 only
so the all-reduce adds them once. gpt-oss's attention sinks (one per query head)
go with their heads. Everything else (embeddings, norms, the LM
head) is replicated: the vocabulary matmul runs on rank 0 alone, where
sampling happens. Splits need not be even: 3 KV heads over 2 ranks are 2 + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.shapes import head_dim_of, num_kv_heads_of


@dataclass(frozen=True)
class ShardLayout:
    """This rank's slices, in rows of the Hugging Face weights."""

    q_rows: slice
    kv_rows: slice
    mlp_rows: slice
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


def shard_layout(config, tp: TensorParallelGroup) -> ShardLayout:
    """Raises ``ValueError`` when some rank would get no KV head or MLP column."""
    heads = config.num_attention_heads
    kv_heads = num_kv_heads_of(config)
    head_dim = head_dim_of(config)
    group = heads // kv_heads
    kv_first, kv_count = tp.split(kv_heads, "KV heads")
    mlp_first, mlp_count = tp.split(config.intermediate_size, "intermediate size")
    return ShardLayout(
        q_rows=slice(kv_first * group * head_dim, (kv_first + kv_count) * group * head_dim),
        kv_rows=slice(kv_first * head_dim, (kv_first + kv_count) * head_dim),
        mlp_rows=slice(mlp_first, mlp_first + mlp_count),
        num_heads=kv_count * group,
        num_kv_heads=kv_count,
        intermediate_size=mlp_count,
    )


def shard_state_dict(state_dict: dict[str, torch.Tensor], config, tp: TensorParallelGroup) -> dict[str, torch.Tensor]:
    """This rank's slices; with one rank, the state dict itself."""
    if tp.world_size == 1:
        return state_dict
    layout = shard_layout(config, tp)
    column = {"self_attn.q_proj": layout.q_rows, "self_attn.k_proj": layout.kv_rows,
              "self_attn.v_proj": layout.kv_rows, "mlp.gate_proj": layout.mlp_rows, "mlp.up_proj": layout.mlp_rows}
    row = {"self_attn.o_proj": layout.q_rows, "mlp.down_proj": layout.mlp_rows}
    shards: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        module, _, kind = name.rpartition(".")
        part = module.split(".", 3)[-1]  # "model.layers.N.self_attn.q_proj" -> "self_attn.q_proj"
        if part in column:
            shards[name] = tensor[column[part]].clone()
        elif part in row and kind == "weight":
            shards[name] = tensor[:, row[part]].clone()
        elif part in row:  # a row-parallel bias: added once, by rank 0
            shards[name] = tensor.clone() if tp.rank == 0 else torch.zeros_like(tensor)
        elif kind == "sinks":  # gpt-oss's logit per query head goes with its head
            head_dim = head_dim_of(config)
            shards[name] = tensor[layout.q_rows.start // head_dim:layout.q_rows.stop // head_dim].clone()
        else:
            shards[name] = tensor
    return shards


def check_tensor_parallel_size(config, world_size: int) -> None:
    """``ValueError`` unless every rank gets at least one KV head and MLP column."""
    shard_layout(config, TensorParallelGroup(rank=world_size - 1, world_size=world_size))

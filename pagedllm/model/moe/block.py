"""The sparse MLP block of one layer: router, experts and Qwen2-MoE's shared expert; under
tensor parallelism this rank's slice of every expert (``moe.sharding``), all-reduced once."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.layers import GatedMLP, Linear
from pagedllm.model.moe.experts import Experts, clamped_swiglu
from pagedllm.model.moe.routers import routing_of
from pagedllm.model.moe.sharding import expert_widths


def num_experts_of(config: PretrainedConfig) -> int:
    """Experts per MoE layer: ``num_experts`` (Qwen, OLMoE) or ``num_local_experts`` (Mixtral, Granite)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


def expert_width_of(config: PretrainedConfig) -> int:
    """One expert's intermediate size: ``moe_intermediate_size`` where the family has one
    (Qwen; its ``intermediate_size`` is the dense layers'), else ``intermediate_size``."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def is_sparse_layer(config: PretrainedConfig, layer: int) -> bool:
    """Whether layer ``layer`` has experts: Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step`` name dense ones, as Hugging Face's decoder layer reads them."""
    if layer in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return num_experts_of(config) > 0 and (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def experts_of(config: PretrainedConfig, width: int) -> Experts:
    """A layer's expert stack, ``width`` wide (this rank's share): gpt-oss's have biases and its clamped SwiGLU (``swiglu_alpha``,
    ``swiglu_limit``; its ``hidden_act`` is not read, as in Hugging Face), the others
    ``hidden_act``-and-multiply without biases."""
    sizes = (num_experts_of(config), config.hidden_size, width)
    if config.model_type == "gpt_oss":
        return Experts(*sizes, act_and_mul=clamped_swiglu(config.swiglu_alpha, config.swiglu_limit), bias=True)
    return Experts(*sizes, getattr(config, "hidden_act", "silu"))


class SparseMoeBlock(nn.Module):
    """router -> top-k experts (grouped forward), plus the sigmoid-gated shared expert
    where the config has one (Qwen2-MoE's ``shared_expert_intermediate_size``). With
    ``tp.world_size`` ranks the experts and the shared expert are this rank's width slices,
    the router and the shared expert's gate whole."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.routing = routing_of(config)
        num_experts = num_experts_of(config)
        width, shared = expert_widths(config, expert_width_of(config), tp)
        # gpt-oss's router is the one with a bias.
        self.gate = Linear(config.hidden_size, num_experts, bias=config.model_type == "gpt_oss")
        self.experts = experts_of(config, width)
        # Unsharded group: its partial sum joins the experts' in the block's one all-reduce.
        self.shared_expert = GatedMLP(config.hidden_size, shared, False) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices, weights = self.routing.route(self.gate(x))
        out = self.experts(x, indices, weights)
        if self.shared_expert is not None:
            # Hugging Face: experts' output + sigmoid(gate(x)) * shared(x), in the model's dtype.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

"""The MoE routers and the grouped expert forward against Hugging Face's own modules.

For every family, the router picks the same experts with the same weights (fp32 and bf16),
and the grouped forward (tokens sorted by expert, one matmul per expert) equals Hugging
Face's eager experts within 1e-6 in fp32 (bf16: within one rounding); gpt-oss's experts
(biases, clamped SwiGLU) load from its transposed, interleaved layout, and its bf16 RMSNorm
rounds as Hugging Face's. Checkpoint names
(per-expert, Mixtral's w1/w3/w2, Granite's stacked input/output linears) load into the
stacked layout; tensor-parallel slices of every expert's width (and of Qwen2-MoE's shared
expert) add up to the whole block; an expert width the ranks cannot split evenly and OLMoE's
clip_qkv are refused.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.gpt_oss import GptOssRMSNorm as OurGptOssRMSNorm
from pagedllm.model.gpt_oss import gpt_oss_expert_layout
from pagedllm.model.layers import RMSNorm
from pagedllm.model.moe.block import SparseMoeBlock, expert_width_of, experts_of
from pagedllm.model.moe.experts import Experts
from pagedllm.model.moe.names import stack_expert_weights
from pagedllm.model.moe.routers import routing_of
from pagedllm.model.moe.sharding import shard_expert_weights
from pagedllm.model.moe.summary import parameter_counts, weights_line
from pagedllm.model.moe_families import MoeForCausalLM
from tests.model.moe_configs import FAMILIES, moe_config, random_moe_model


def _hf_block(model: torch.nn.Module) -> torch.nn.Module:
    layer = model.model.layers[0]
    return getattr(layer, "mlp", None) if not hasattr(layer, "block_sparse_moe") else layer.block_sparse_moe


def _hf_router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_router_and_grouped_experts_equal_hugging_face(family: str, dtype: torch.dtype) -> None:
    config = moe_config(family, 128)
    model = random_moe_model(config).to(dtype)
    block = _hf_block(model)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_indices = _hf_router(block)(x)
        router = _hf_router(block)
        indices, weights = routing_of(config).route(torch.nn.functional.linear(x, router.weight,
                                                                               getattr(router, "bias", None)))
        assert torch.equal(indices, hf_indices) and weights.dtype == hf_weights.dtype
        assert torch.equal(weights, hf_weights)
        assert len(indices.unique()) == 8, "the scaled router sends tokens to every expert"
        ours, theirs = _ours(config, block.experts)(x, indices, weights), block.experts(x, hf_indices, hf_weights)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)


def _ours(config, hf_experts: torch.nn.Module) -> Experts:
    """The family's expert stack holding Hugging Face's expert weights, converted as at load."""
    prefix = "model.layers.0.mlp.experts."
    tensors = {prefix + name: param.detach() for name, param in hf_experts.named_parameters()}
    if config.model_type == "gpt_oss":
        gpt_oss_expert_layout(tensors)
    experts = experts_of(config, expert_width_of(config))
    experts.load_state_dict({name.removeprefix(prefix): t for name, t in tensors.items()}, assign=True)
    return experts


def test_gpt_oss_clamps_bite() -> None:
    """Inputs large enough that gpt-oss's gate and up clamps (limit 0.2) cut most values:
    the grouped forward still equals Hugging Face's experts."""
    config = moe_config("gpt_oss", 128)
    block = _hf_block(random_moe_model(config))
    x = 20 * torch.randn(23, 64, generator=torch.Generator().manual_seed(2))
    indices = torch.randint(0, 8, (23, 2), generator=torch.Generator().manual_seed(3))
    indices[:, 1] = (indices[:, 0] + 1) % 8
    weights = torch.rand(23, 2, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        gate_up = x @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.5
        torch.testing.assert_close(_ours(config, block.experts)(x, indices, weights),
                                   block.experts(x, indices, weights), rtol=1e-5, atol=1e-5)


def test_gpt_oss_norm_rounds_as_hugging_face() -> None:
    """bf16: gpt-oss's RMSNorm multiplies its weight in fp32 and rounds once, bit for bit as
    Hugging Face's ``GptOssRMSNorm``; Llama's order (round, then multiply in bf16) differs."""
    generator = torch.Generator().manual_seed(5)
    hf = GptOssRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    ours, llama = OurGptOssRMSNorm(64, 1e-5), RMSNorm(64, 1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64, generator=generator) * 0.3 + 1)
    ours.weight, llama.weight = (torch.nn.Parameter(hf.weight.detach().clone()) for _ in range(2))
    x, residual = (torch.randn(37, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        out, summed = ours(x, residual.clone())
        assert torch.equal(summed, residual + x) and torch.equal(out, hf(residual + x))
        assert not torch.equal(llama(residual + x), hf(residual + x))


def test_checkpoint_names_stack_into_experts() -> None:
    gate, up, down = (torch.randn(3, 8, 4), torch.randn(3, 8, 4), torch.randn(3, 4, 8))
    mixtral = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": t[e]
               for e in range(3) for w, t in (("w1", gate), ("w3", up), ("w2", down))}
    mixtral["model.layers.0.block_sparse_moe.gate.weight"] = torch.zeros(3, 4)
    stack_expert_weights(mixtral)
    assert torch.equal(mixtral["model.layers.0.mlp.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    assert torch.equal(mixtral["model.layers.0.mlp.experts.down_proj"], down)
    assert sorted(mixtral) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
                               "model.layers.0.mlp.gate.weight"]
    granite = {"model.layers.1.block_sparse_moe.input_linear.weight": torch.cat([gate, up], dim=1),
               "model.layers.1.block_sparse_moe.output_linear.weight": down,
               "model.layers.1.block_sparse_moe.router.layer.weight": torch.zeros(3, 4)}
    stack_expert_weights(granite)
    assert sorted(granite) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                               "model.layers.1.mlp.gate.weight"]
    partial = {"model.layers.0.mlp.experts.0.gate_proj.weight": gate[0]}
    with pytest.raises(ValueError, match="expected gate, up and down"):
        stack_expert_weights(partial)


def test_refusals_name_what_to_change() -> None:
    with torch.device("meta"):
        with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's expert width .*\(32\)"):
            MoeForCausalLM(moe_config("mixtral", 128), tp=TensorParallelGroup(rank=0, world_size=3))
        with pytest.raises(ValueError, match=r"does not divide the model's shared_expert_intermediate_size \(40\)"):
            MoeForCausalLM(moe_config("qwen2_moe", 128, moe_intermediate_size=48), tp=TensorParallelGroup(0, 3))
        with pytest.raises(ValueError, match="clip_qkv"):
            MoeForCausalLM(moe_config("olmoe", 128, clip_qkv=8.0))
        with pytest.raises(ValueError, match="gpt-oss checkpoints quantized with 'mxfp4'"):
            MoeForCausalLM(moe_config("gpt_oss", 128, quantization_config={"quant_method": "mxfp4"}))


def test_active_parameters_count_top_k_of_each_expert_stack() -> None:
    config = moe_config("qwen2_moe", 128)
    with torch.device("meta"):
        model = MoeForCausalLM(config)
    total, active = parameter_counts(model)
    experts = 2 * 8 * (3 * 64 * 32)  # two sparse layers of 8 experts; 2 of the 8 run per token
    assert total - active == experts * 6 // 8
    assert weights_line(model, 3 * 2**30).startswith("weights: 3.00 GiB, ")
    assert weights_line(model, 0).endswith(f"{active / 1000:.1f}K of {total / 1000:.1f}K parameters active per token")


def test_expert_width_slices_add_up_to_the_whole_block() -> None:
    """Qwen2-MoE's block (8 experts of width 32, a shared expert of 40) over 2 ranks: each rank
    keeps its gate rows then its up rows of every expert, the same columns of down; the router
    and the shared expert's gate stay whole; the ranks' outputs sum to the whole block's."""
    config = moe_config("qwen2_moe", 128)
    prefix = "model.layers.0.mlp."
    whole = {k: v for k, v in random_moe_model(config).state_dict().items() if k.startswith(prefix)}
    stack_expert_weights(whole)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    outputs, slices = [], []
    for tp in (TensorParallelGroup(0, 2), TensorParallelGroup(1, 2)):
        shard = dict(whole)
        shard_expert_weights(shard, tp)
        block = SparseMoeBlock(config, tp)
        block.load_state_dict({k.removeprefix(prefix): v for k, v in shard.items()})
        block.tp = SINGLE  # the sum below stands in for the all-reduce
        assert block.experts.gate_up_proj.shape == (8, 32, 64) and block.shared_expert.down_proj.weight.shape == (64, 20)
        with torch.no_grad():
            outputs.append(block(x))
        slices.append(block.experts.gate_up_proj.detach())
    full = SparseMoeBlock(config)
    full.load_state_dict({k.removeprefix(prefix): v for k, v in whole.items()})
    gate_up = whole[f"{prefix}experts.gate_up_proj"]
    assert torch.equal(torch.cat([s[:, :16] for s in slices], dim=1), gate_up[:, :32])  # the gate rows
    assert torch.equal(torch.cat([s[:, 16:] for s in slices], dim=1), gate_up[:, 32:])  # the up rows
    with torch.no_grad():
        torch.testing.assert_close(outputs[0] + outputs[1], full(x), rtol=1e-5, atol=1e-5)

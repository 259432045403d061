"""The grouped expert kernel (kernels/csrc/moe_grouped.cpp through ``moe.grouped``) against
the per-expert Python loop, on dense fp32 and bf16 stacks and on packed GGUF stacks
(Q8_0, the K types, MXFP4), for a batch whose pairs hit every expert, one where all tokens go to
the same experts, and a single token; gpt-oss's expert biases (dense and packed stacks) on
the grouped path.

Tolerances: the kernel and MKL sum each dot product in different orders, so fp32 outputs
agree to fp32 rounding of the sums (1e-5 of the outputs' largest magnitude: random packed
blocks make large weights and sums that cancel); bf16 adds one bf16 rounding of each
projection (2^-7). The combine (each token's k terms summed in increasing
expert id) is exact: with every projection forced equal, the two paths agree to the bit.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.layers import GATED_ACTIVATIONS
from pagedllm.model.moe import experts as experts_module
from pagedllm.model.moe import grouped
from pagedllm.model.moe import packed_experts as packed_module
from pagedllm.model.moe.experts import Experts
from pagedllm.model.moe.packed_experts import PackedExperts, PackedExpertWeight
from tests.model.quantized_blocks import random_blocks

EXPERTS, HIDDEN, WIDTH, TOP_K = 8, 256, 96, 3


@pytest.fixture(scope="module")
def kernels():
    module = load_cpu_kernels()
    if module is None:
        pytest.skip("the C++ CPU kernels did not build")
    return module


def _routing(tokens: int, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    if case == "same":  # every token on experts 5, 2, 7
        indices = torch.tensor([[5, 2, 7]]).repeat(tokens, 1)
    else:  # distinct experts per token; with 24 tokens every expert gets some
        indices = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator)
    return indices, weights / weights.sum(-1, keepdim=True)


def _dense_experts(dtype: torch.dtype, bias: bool = False) -> Experts:
    torch.manual_seed(0)
    experts = Experts(EXPERTS, HIDDEN, WIDTH, bias=bias)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
        if bias:
            experts.gate_up_proj_bias.normal_(0, 0.1)
            experts.down_proj_bias.normal_(0, 0.1)
    return experts.to(dtype)


def _loop(experts, x, indices, weights) -> torch.Tensor:
    return grouped.loop_forward(x, indices, weights, experts.num_experts, experts.expert_forward)


@pytest.mark.parametrize("tokens,case", [(24, "all"), (24, "same"), (1, "all")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_grouped_equals_the_loop(kernels, dtype, tokens, case):
    experts = _dense_experts(dtype)
    x = torch.randn(tokens, HIDDEN).to(dtype)
    indices, weights = _routing(tokens, case)
    weights = weights.to(dtype)
    if case == "all" and tokens > 1:
        assert set(indices.flatten().tolist()) == set(range(EXPERTS))
    actual, expected = experts(x, indices, weights), _loop(experts, x, indices, weights)
    assert actual.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance * 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_experts_take_the_grouped_kernel(kernels, dtype, monkeypatch):
    """gpt-oss's expert biases, dense and beside packed MXFP4 stacks: the grouped path (the loop
    refused) adds each row's expert's bias after each projection, as the loop does."""
    for module in (experts_module, packed_module):
        monkeypatch.setattr(module, "loop_forward", lambda *args: pytest.fail("the loop ran"))
    dense = _dense_experts(dtype, bias=True)
    x = torch.randn(24, HIDDEN).to(dtype)
    indices, weights = _routing(24, "all")
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
    weights = weights.to(dtype)
    torch.testing.assert_close(dense(x, indices, weights).float(), _loop(dense, x, indices, weights).float(),
                               rtol=tolerance, atol=tolerance * 0.1)
    packed = PackedExperts([_packed_stack(T.MXFP4, WIDTH, HIDDEN, 1), _packed_stack(T.MXFP4, WIDTH, HIDDEN, 2)],
                           _packed_stack(T.MXFP4, HIDDEN, WIDTH, 3), GATED_ACTIVATIONS["silu"], bias=True)
    packed.gate_up_proj_bias = torch.nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH))
    packed.down_proj_bias = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN))
    _assert_packed_matches_the_loop(packed, 24, "all")


def _packed_stack(qtype: T, rows: int, columns: int, seed: int) -> PackedExpertWeight:
    blocks = torch.from_numpy(random_blocks(qtype, EXPERTS * rows, columns, seed)).reshape(EXPERTS, rows, -1)
    return PackedExpertWeight(blocks.contiguous(), qtype, (EXPERTS, rows, columns), torch.float32)


def _assert_packed_matches_the_loop(experts: PackedExperts, tokens: int, case: str) -> None:
    x = torch.randn(tokens, HIDDEN)
    indices, weights = _routing(tokens, case)
    actual, expected = experts(x, indices, weights), _loop(experts, x, indices, weights)
    scale = expected.abs().max().item()
    assert scale > 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens,case", [(24, "all"), (24, "same"), (60, "all")])
def test_packed_grouped_equals_the_loop(kernels, qtype, tokens, case):
    """60 tokens: experts with more than 48 rows decode through the fp32 scratch, not registers."""
    width = 256  # whole Q4_K blocks on both sides
    experts = PackedExperts([_packed_stack(qtype, width, HIDDEN, 1), _packed_stack(qtype, width, HIDDEN, 2)],
                            _packed_stack(qtype, HIDDEN, width, 3), GATED_ACTIVATIONS["silu"])
    assert len(experts.stacks()[0]) == 1, "gate and up of one type run as one segment"
    _assert_packed_matches_the_loop(experts, tokens, case)


def test_gate_and_up_of_different_types_run_as_two_segments(kernels):
    """A GGUF may store gate and up in different types (and down in a third)."""
    experts = PackedExperts([_packed_stack(T.Q8_0, 256, HIDDEN, 1), _packed_stack(T.MXFP4, 256, HIDDEN, 2)],
                            _packed_stack(T.Q6_K, HIDDEN, 256, 3), GATED_ACTIVATIONS["silu"])
    assert [len(segments) for segments in experts.stacks()] == [2, 1]
    _assert_packed_matches_the_loop(experts, 24, "all")


def test_the_combine_sums_in_expert_order(kernels, monkeypatch):
    """With the projections made identical (the kernel's output for both paths), the grouped
    forward and the loop agree to the bit: the sum over each token's experts is the loop's."""
    experts = _dense_experts(torch.float32)
    x = torch.randn(24, HIDDEN)
    indices, weights = _routing(24, "all")
    stacks = {0: grouped.dense_stack(experts.gate_up_proj), 1: grouped.dense_stack(experts.down_proj)}

    def kernel_project(rows: torch.Tensor, stack: grouped.ExpertStack, expert: int) -> torch.Tensor:
        one = stack.weights[expert:expert + 1].contiguous()
        out = torch.empty(rows.shape[0], one.shape[1])
        kernels.moe_grouped_linear(rows.contiguous(), one, 0, torch.tensor([0, rows.shape[0]]), out)
        return out

    def expert_forward(expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = experts.act_and_mul(kernel_project(rows, stacks[0], expert))
        return kernel_project(hidden, stacks[1], expert)

    monkeypatch.setattr(experts, "expert_forward", expert_forward)
    assert torch.equal(experts(x, indices, weights), _loop(experts, x, indices, weights))


def test_without_the_kernels_the_loop_runs(monkeypatch):
    experts = _dense_experts(torch.float32)
    x = torch.randn(5, HIDDEN)
    indices, weights = _routing(5, "all")
    monkeypatch.setattr(grouped, "cpu_kernels_for", lambda tensor: None)
    assert torch.equal(experts(x, indices, weights), _loop(experts, x, indices, weights))

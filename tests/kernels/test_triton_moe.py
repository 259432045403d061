"""The Triton fused MoE kernel (``kernels.triton_moe``) against the Python expert loop
(``Experts.forward`` on CPU), through Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU): a batch whose pairs hit every expert, one where
every token goes to the same two experts (one expert's run spans several blocks, six experts
have none), a hidden size no tile divides (masked loads and stores), fp32 and bf16, and
gpt-oss's experts (biases, clamped SwiGLU).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton_moe import BLOCK_M, align_pairs, fused_experts
from pagedllm.model.moe.experts import Experts, clamped_swiglu


def _experts(hidden: int, width: int, dtype: torch.dtype, biased: bool = False) -> Experts:
    """Random experts; ``biased``: gpt-oss's, with biases and its clamped SwiGLU (limit 0.5,
    so the clamps cut)."""
    generator = torch.Generator().manual_seed(0)
    act = clamped_swiglu(1.702, 0.5) if biased else None
    experts = Experts(8, hidden, width, act_and_mul=act, bias=biased)
    experts.gate_up_proj.data = (torch.randn(8, 2 * width, hidden, generator=generator) / hidden**0.5).to(dtype)
    experts.down_proj.data = (torch.randn(8, hidden, width, generator=generator) / width**0.5).to(dtype)
    if biased:
        experts.gate_up_proj_bias.data = (torch.randn(8, 2 * width, generator=generator) * 0.1).to(dtype)
        experts.down_proj_bias.data = (torch.randn(8, hidden, generator=generator) * 0.1).to(dtype)
    return experts


def _routing(tokens: int, same: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if same:
        indices = torch.tensor([[5, 2]]).repeat(tokens, 1)
    else:
        indices = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1)
    return indices, weights


@pytest.mark.parametrize("same,dtype,biased", [(False, torch.float32, False), (False, torch.bfloat16, False),
                                               (True, torch.float32, False), (False, torch.bfloat16, True)],
                         ids=["every-expert-fp32", "every-expert-bf16", "all-same-experts-fp32", "gpt-oss-bf16"])
def test_fused_kernel_equals_the_expert_loop(same: bool, dtype: torch.dtype, biased: bool) -> None:
    experts = _experts(48, 32, dtype, biased)
    indices, weights = _routing(21, same)
    assert len(indices.unique()) == (2 if same else 8)
    x = torch.randn(21, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        expected = experts(x, indices, weights.to(dtype))
        ours = fused_experts(x, experts.gate_up_proj, experts.down_proj, indices, weights.to(dtype),
                             experts.act_and_mul, (experts.gate_up_proj_bias, experts.down_proj_bias))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, expected, rtol=tolerance, atol=tolerance)


def test_pairs_are_grouped_by_expert_and_padded_per_block() -> None:
    indices = torch.tensor([[3, 0], [0, 3], [3, 1]])
    sorted_pairs, block_experts, num_padded = align_pairs(indices, 4)
    pad = indices.numel()
    runs = [[1, 2], [5], [0, 3, 4]]  # expert 0's pairs, expert 1's, expert 3's (expert 2 has none)
    expected = [pair for run in runs for pair in run + [pad] * (BLOCK_M - len(run))]
    assert num_padded.tolist() == [3 * BLOCK_M]
    assert sorted_pairs[:3 * BLOCK_M].tolist() == expected
    assert (sorted_pairs[3 * BLOCK_M:] == pad).all()
    assert block_experts[:3].tolist() == [0, 1, 3]

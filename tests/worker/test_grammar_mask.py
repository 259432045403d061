"""The sampler's grammar step: only guided rows are masked, as a packed bitmask."""

from __future__ import annotations

import math

import torch
import xgrammar as xgr

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingMetadata
from pagedllm.worker.sampling.grammar import RowBitmask, mask_guided_rows

VOCAB = 100


def bitmask_allowing(*allowed: list[int]) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(len(allowed), VOCAB)
    bitmask.zero_()
    for row, tokens in enumerate(allowed):
        for token in tokens:
            word, bit = divmod(token, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
    return bitmask


def test_only_the_guided_rows_are_masked_in_place():
    logits = torch.randn(4, VOCAB)
    original = logits.clone()
    mask_guided_rows(logits, RowBitmask([1, 3], bitmask_allowing([5, 31, 63], [99])))
    assert torch.equal(logits[[0, 2]], original[[0, 2]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 31, 63]
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [99]
    assert torch.equal(logits[1, [5, 31, 63]], original[1, [5, 31, 63]])


def test_sampler_draws_only_allowed_tokens_for_guided_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0)]
    metadata = SamplingMetadata(params, [1, 2, 3], [0, 0, 0], [[1], [1], [1]], [[], [], []])
    free = Sampler([0])(logits.clone(), metadata)
    guided = Sampler([0])(logits.clone(), metadata, RowBitmask([0, 1], bitmask_allowing([7, 8], [40])))
    assert guided.sampled_token_ids[0] in (7, 8) and guided.sampled_token_ids[1] == 40
    assert guided.sampled_token_ids[2] == free.sampled_token_ids[2]
    # Logprobs of a guided row are over the tokens its grammar allows (vLLM's order).
    allowed = logits[0, [7, 8]].float()
    chosen = guided.sampled_token_ids[0]
    expected = logits[0, chosen].float() - torch.logsumexp(allowed, dim=0)
    assert math.isclose(guided.sampled_logprobs[0], expected.item(), rel_tol=1e-5)
    assert set(guided.logprobs[0]) == {7, 8}

"""Verification keeps the target distribution: greedy rows exactly, random
rows in distribution (a chi-square test over thousands of seeded draws)."""

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.spec_decode.rejection import verify_drafts
from pagedllm.worker.sampling.draw import target_probs
from pagedllm.worker.sampling.metadata import SamplingMetadata

EOS = 99
# 0.999 quantiles of chi-square by degrees of freedom (support size - 1).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def metadata_for(params, num_rows, seeds=None, positions=None):
    return SamplingMetadata(
        params=[params] * num_rows,
        seeds=seeds or [0] * num_rows,
        output_positions=positions or list(range(num_rows)),
        prompt_token_ids=[[1]] * num_rows,
        output_token_ids=[[]] * num_rows,
    )


def test_greedy_accepts_the_drafts_that_match_the_argmax_and_closes_with_it():
    logits = torch.full((4, 8), -1.0)
    for row, best in enumerate([3, 5, 2, 6]):
        logits[row, best] = 4.0
    params = SamplingParams(temperature=0.0)
    (result,) = verify_drafts(logits, metadata_for(params, 4), [[3, 5, 2]], [EOS])
    assert result.token_ids == [3, 5, 2, 6] and result.num_accepted_drafts == 3  # all accepted + bonus
    (result,) = verify_drafts(logits, metadata_for(params, 4), [[3, 1, 2]], [EOS])
    assert result.token_ids == [3, 5]  # the second draft is wrong: the argmax replaces it
    expected = torch.log_softmax(logits, dim=-1)
    assert result.logprobs == pytest.approx([expected[0, 3].item(), expected[1, 5].item()])


def test_penalties_see_the_drafts_before_each_row():
    # Row 1 follows draft 3: a repetition penalty must push 3 below 4 there.
    logits = torch.tensor([[0.0, 0, 0, 5.0, 4.9, 0], [0.0, 0, 0, 5.0, 4.9, 0]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    metadata = metadata_for(params, 2)
    metadata.output_token_ids = [[], [3]]
    (result,) = verify_drafts(logits, metadata, [[3]], [EOS])
    assert result.token_ids == [3, 4]


def sampled_first_and_second(logits_row, params, draft, num_trials):
    """Verify one draft per trial (seed = trial): returns the first tokens, and
    the second token of the trials that accepted the draft."""
    logits = logits_row.repeat(2 * num_trials, 1)
    metadata = metadata_for(params, 2 * num_trials, seeds=[t for t in range(num_trials) for _ in (0, 1)],
                            positions=[0, 1] * num_trials)
    results = verify_drafts(logits, metadata, [[draft]] * num_trials, [EOS])
    first = [r.token_ids[0] for r in results]
    second = [r.token_ids[1] for r in results if r.num_accepted_drafts == 1]
    return first, second


def chi_square(tokens, probs):
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item(), int(keep.sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
@pytest.mark.parametrize("draft", [1, 4])
def test_random_rows_keep_the_target_distribution(params, draft):
    torch.manual_seed(0)
    logits_row = torch.randn(6) * 1.5
    probs = target_probs(logits_row[None].clone(), [params])[0]
    first, second = sampled_first_and_second(logits_row, params, draft, 6000)
    statistic, support = chi_square(first, probs)
    # A verifier that always (or never) accepted the draft would be far off.
    assert statistic < CHI2_999[support - 1], (statistic, probs)
    assert abs(first.count(draft) / len(first) - probs[draft].item()) < 0.03
    # After an accepted draft the bonus row draws from its own distribution.
    statistic, support = chi_square(second, probs)
    assert statistic < CHI2_999[support - 1]


def test_logprobs_are_reported_for_every_kept_token():
    torch.manual_seed(1)
    logits = torch.randn(3, 10)
    params = SamplingParams(temperature=0.0, logprobs=2)
    best = logits.argmax(dim=-1).tolist()
    (result,) = verify_drafts(logits, metadata_for(params, 3), [[best[0], best[1]]], [EOS])
    assert result.token_ids == best
    raw = torch.log_softmax(logits, dim=-1)
    for row, (token, entry) in enumerate(zip(result.token_ids, result.position_logprobs)):
        assert entry[token].logprob == pytest.approx(raw[row, token].item(), abs=1e-5)
        assert len(entry) == 2 and entry[token].rank == 1

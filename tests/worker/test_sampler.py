"""Sampler: vLLM sampling semantics, seed reproducibility and raw logprobs."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.worker.sampling import draw as sampling_draw

EOS = 3
PROBS4 = [0.5, 0.3, 0.15, 0.05]
LOGITS4 = [math.log(p) for p in PROBS4]


def make_metadata(
    params: list[SamplingParams],
    *,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingMetadata:
    """Metadata with empty prompts/outputs, seeds 0..n-1 and positions len(output) by default."""
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingMetadata(
        params=params,
        seeds=seeds if seeds is not None else list(range(n)),
        output_positions=positions if positions is not None else [len(o) for o in outputs],
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs,
    )


def sample_many(
    logits_row: list[float], params: SamplingParams, num: int, *, vary: str = "seed"
) -> list[int]:
    """Sample the same row `num` times, varying either the seed or the position."""
    logits = torch.tensor([logits_row] * num)
    if vary == "seed":
        metadata = make_metadata([params] * num, seeds=list(range(num)), positions=[0] * num)
    else:
        metadata = make_metadata([params] * num, seeds=[12345] * num, positions=list(range(num)))
    return Sampler([EOS])(logits, metadata).sampled_token_ids


def chi_square(tokens: list[int], probs: list[float]) -> float:
    n = len(tokens)
    return sum((tokens.count(t) - n * p) ** 2 / (n * p) for t, p in enumerate(probs))


# Chi-square critical value for 5 degrees of freedom at p = 0.001.
CHI2_DF5_P001 = 20.52


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 16
    out = Sampler([EOS])(logits, make_metadata(params))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_are_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    out = Sampler([EOS])(logits, make_metadata(params))
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.sampled_token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


def test_callers_logits_are_not_modified() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0),
        SamplingParams(min_tokens=3, stop_token_ids=[5]),
        SamplingParams(top_k=5, top_p=0.5, min_p=0.1, temperature=0.7),
        SamplingParams(temperature=0.0),
    ]
    metadata = make_metadata(params, outputs=[[1, 2, 2], [], [4], []], prompts=[[7], [], [], []])
    Sampler([EOS])(logits, metadata)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_sample_exactly_as_their_fp32_values(dtype) -> None:
    """bf16/fp16 logits (a bf16 model's) give the tokens their exact fp32 upcast
    gives, and the logprobs to fp32 rounding (the log-normaliser's sum may run in
    another order): greedy-only batches are read in place, others upcast first."""
    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    before = logits.clone()
    greedy = [SamplingParams(temperature=0.0)] * 6
    mixed = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[5, 6], [], [], [], [7], []]
    for params in (greedy, mixed):
        metadata = make_metadata(params, outputs=outputs)
        low = Sampler([EOS])(logits, metadata)
        exact = Sampler([EOS])(logits.float(), metadata)
        assert low.sampled_token_ids == exact.sampled_token_ids
        assert low.sampled_logprobs == pytest.approx(exact.sampled_logprobs, rel=1e-5, abs=1e-5)
        assert low.logprobs == exact.logprobs
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_temperature_sampling_matches_softmax(vary: str) -> None:
    logits = [1.0, 0.5, 0.0, -0.5, 0.2, 0.8]
    temperature = 0.5
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=0).tolist()
    tokens = sample_many(logits, SamplingParams(temperature=temperature), 6000, vary=vary)
    assert chi_square(tokens, expected) < CHI2_DF5_P001
    # The untempered distribution is clearly rejected: temperature is applied.
    untempered = torch.softmax(torch.tensor(logits), dim=0).tolist()
    assert chi_square(tokens, untempered) > 10 * CHI2_DF5_P001


def test_top_k_1_is_argmax() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 64
    out = Sampler([EOS])(logits, make_metadata(params))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_never_leaves_the_top_k() -> None:
    row = torch.randn(50, generator=torch.Generator().manual_seed(4))
    top5 = set(row.topk(5).indices.tolist())
    tokens = sample_many(row.tolist(), SamplingParams(temperature=2.0, top_k=5), 2000)
    assert set(tokens) == top5


@pytest.mark.parametrize("top_p", [1e-6, 5e-324])  # 5e-324: the smallest double, 0 in float32
def test_tiny_top_p_is_argmax(top_p: float) -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * 64
    out = Sampler([EOS])(logits, make_metadata(params))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # 0.5 < 0.6 <= 0.5 + 0.3: tokens 0 and 1 are kept, renormalised to 0.625 / 0.375.
    tokens = sample_many(LOGITS4, SamplingParams(top_p=0.6), 4000)
    assert set(tokens) == {0, 1}
    assert abs(tokens.count(0) / 4000 - 0.625) < 0.03


def test_top_p_applies_after_top_k() -> None:
    # After top_k=2 the survivors are 0.625 / 0.375, so top_p=0.6 keeps only token 0
    # (on the unfiltered distribution it would keep tokens 0 and 1).
    tokens = sample_many(LOGITS4, SamplingParams(top_k=2, top_p=0.6), 500)
    assert set(tokens) == {0}


def test_top_p_applies_after_temperature() -> None:
    # At temperature 0.25 the probabilities are ~[0.88, 0.11, 0.01, 0.0]: top_p=0.85
    # keeps token 0 only (at temperature 1 it would keep tokens 0 and 1).
    tokens = sample_many(LOGITS4, SamplingParams(temperature=0.25, top_p=0.85), 500)
    assert set(tokens) == {0}


def test_top_k_only_and_top_p_rows_in_one_batch() -> None:
    logits = torch.tensor([LOGITS4] * 400)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.4),
        SamplingParams(),
        SamplingParams(top_k=3, top_p=0.99),
    ]
    metadata = make_metadata(params * 100, seeds=list(range(400)), positions=[0] * 400)
    out = Sampler([EOS])(logits, metadata)
    by_kind = [set(out.sampled_token_ids[i::4]) for i in range(4)]
    assert by_kind == [{0, 1}, {0}, {0, 1, 2, 3}, {0, 1, 2}]


def top_p_prefix(logits: list[float], top_p: float) -> set[int]:
    """Float64 reference: the smallest set of most likely tokens whose mass reaches top_p."""
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    kept, mass = set(), 0.0
    for i in sorted(range(len(logits)), key=lambda i: -logits[i]):
        if mass >= top_p * total:
            break
        kept.add(i)
        mass += weights[i]
    return kept


def test_top_p_beyond_the_candidate_tokens_falls_back_to_a_full_sort() -> None:
    # A nearly flat distribution over 3000 tokens: half the mass needs ~1500 tokens,
    # more than the top-p candidates, so the row is sorted in full.
    vocab = 3000
    assert sampling_draw._TOP_P_CANDIDATES < vocab // 2
    logits = torch.linspace(0.0, 1.0, vocab)
    logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(9))].tolist()
    allowed = top_p_prefix(logits, 0.5)
    tokens = sample_many(logits, SamplingParams(top_p=0.5), 600)
    assert set(tokens) <= allowed
    # About a tenth of the kept mass lies beyond the most likely 1024 tokens.
    beyond = set(sorted(range(vocab), key=lambda i: -logits[i])[1024:])
    assert sum(t in beyond for t in tokens) > 20


@pytest.mark.parametrize("num_candidates", [1, 7, 10_000])
def test_top_p_cut_does_not_depend_on_the_candidate_count(
    num_candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = torch.Generator().manual_seed(10)
    logits = torch.randn(64, 300, generator=rng) * torch.rand(64, 1, generator=rng) * 4
    params = [SamplingParams(top_p=0.05 + 0.9 * i / 63, temperature=0.8) for i in range(64)]
    metadata = make_metadata(params)
    reference = Sampler([EOS])(logits, metadata).sampled_token_ids
    monkeypatch.setattr(sampling_draw, "_TOP_P_CANDIDATES", num_candidates)
    assert Sampler([EOS])(logits, metadata).sampled_token_ids == reference
    for row, token in enumerate(reference):
        assert token in top_p_prefix((logits[row] / 0.8).tolist(), params[row].top_p + 1e-4)


def test_top_k_and_top_p_keep_ties_with_the_last_kept_token() -> None:
    logits = [2.0, 1.0, 1.0, 0.0]
    assert set(sample_many(logits, SamplingParams(top_k=2), 500)) == {0, 1, 2}
    # Token 0 alone has ~0.53 < 0.55, so the cut falls on the 1.0 tie.
    assert set(sample_many(logits, SamplingParams(top_p=0.55), 500)) == {0, 1, 2}


@pytest.mark.parametrize(("min_p", "allowed"), [(0.2, {0, 1, 2}), (0.7, {0}), (0.0, {0, 1, 2, 3})])
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, allowed: set[int]) -> None:
    # Threshold min_p * 0.5: 0.1 drops only the 0.05 token; 0.35 keeps only the 0.5 one.
    tokens = sample_many(LOGITS4, SamplingParams(min_p=min_p), 3000)
    assert set(tokens) == allowed


def test_min_p_applies_after_top_p() -> None:
    # top_p first: the mass before token 2 is 0.8 < 0.82, so tokens 0-2 survive, and
    # min_p (threshold 0.1) keeps them all. min_p first would renormalise 0-2 to
    # [0.53, 0.32, 0.16] and top_p would then drop token 2.
    tokens = sample_many(LOGITS4, SamplingParams(top_p=0.82, min_p=0.2), 3000)
    assert set(tokens) == {0, 1, 2}


# --------------------------------------------------------------------------- penalties


def greedy_choice(
    target_logit: float,
    competitor_logit: float,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
) -> int:
    """Greedy pick between token 0 (target) and token 1 (competitor); others are far lower."""
    logits = torch.full((1, 8), -100.0)
    logits[0, 0] = target_logit
    logits[0, 1] = competitor_logit
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
    )
    metadata = make_metadata([params], prompts=[prompt], outputs=[output])
    return Sampler([EOS])(logits, metadata).sampled_token_ids[0]


@pytest.mark.parametrize(
    ("target_logit", "params", "prompt", "output", "penalized"),
    [
        # Repetition: positive logits are divided, negative ones multiplied.
        (2.0, SamplingParams(repetition_penalty=2.0), [], [0], 1.0),
        (-1.0, SamplingParams(repetition_penalty=2.0), [], [0], -2.0),
        (2.0, SamplingParams(repetition_penalty=0.5), [], [0], 4.0),
        # Prompt tokens count for repetition...
        (2.0, SamplingParams(repetition_penalty=2.0), [0, 5], [], 1.0),
        # ...once, however often the token occurs.
        (2.0, SamplingParams(repetition_penalty=2.0), [0, 0], [0, 0], 1.0),
        # Unseen tokens are untouched.
        (2.0, SamplingParams(repetition_penalty=2.0), [5], [6], 2.0),
        # Frequency: penalty * count in the output.
        (2.0, SamplingParams(frequency_penalty=0.5), [], [0, 4, 0, 0], 0.5),
        (2.0, SamplingParams(frequency_penalty=-0.5), [], [0, 0], 3.0),
        # Frequency and presence ignore the prompt.
        (2.0, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), [0, 0], [], 2.0),
        # Presence: once, whatever the count.
        (2.0, SamplingParams(presence_penalty=0.5), [], [0, 0, 0], 1.5),
        # vLLM's order: repetition first, then frequency, then presence:
        # 2 / 2 - 0.5 * 2 - 0.25 (frequency first would give 0.375).
        (
            2.0,
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [],
            [0, 0],
            -0.25,
        ),
    ],
)
def test_penalty_formula(
    target_logit: float,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    penalized: float,
) -> None:
    # The target's penalized logit lies strictly between the two competitor values.
    assert greedy_choice(target_logit, penalized - 0.01, params, prompt, output) == 0
    assert greedy_choice(target_logit, penalized + 0.01, params, prompt, output) == 1


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[2.0, 1.5, -9.0, -9.0]] * 2)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler([EOS])(logits, make_metadata(params, outputs=[[0], [0]]))
    assert out.sampled_token_ids == [1, 0]


def test_penalties_also_apply_to_random_rows() -> None:
    # Token 0 dominates; a presence penalty of 2 after it was generated makes token 1 dominate.
    logits = [5.0, 4.0, -20.0, -20.0]
    params = SamplingParams(presence_penalty=2.0, top_k=1)
    out = Sampler([EOS])(torch.tensor([logits]), make_metadata([params], outputs=[[0]]))
    assert out.sampled_token_ids == [1]


# --------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_token_ids(ignore_eos: bool) -> None:
    # Preference order: EOS (3), stop token 2, then token 1.
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -5.0]])
    params = SamplingParams(
        temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=ignore_eos
    )

    def pick(position: int) -> int:
        metadata = make_metadata([params], outputs=[[4] * position])
        return Sampler([EOS])(logits, metadata).sampled_token_ids[0]

    assert [pick(0), pick(1), pick(2)] == [1, 1, EOS]


def test_min_tokens_masks_every_eos_id_for_random_rows() -> None:
    logits = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # An id outside the vocabulary is harmless.
    params = SamplingParams(min_tokens=1, stop_token_ids=[5, 10**6])
    tokens = Sampler([3, 4])(
        torch.tensor([logits] * 600), make_metadata([params] * 600, seeds=list(range(600)))
    ).sampled_token_ids
    assert set(tokens) == {0, 1, 2}


# --------------------------------------------------------------------------- reproducibility


@dataclass
class Row:
    """One logits row and its sampling metadata."""

    logits: list[float]
    params: SamplingParams
    seed: int
    prompt: list[int]
    output: list[int]


def random_other_row(rng: random.Random, vocab: int) -> Row:
    params = rng.choice(
        [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_k=rng.randint(1, 50)),
            SamplingParams(temperature=1.3, top_p=rng.uniform(0.1, 0.99)),
            SamplingParams(min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=5),
            SamplingParams(logprobs=3),
        ]
    )
    logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    return Row(logits, params, rng.randrange(2**40), prompt, output)


def sample_in_batch(rows: list[Row]) -> list[int]:
    logits = torch.tensor([r.logits for r in rows])
    metadata = make_metadata(
        [r.params for r in rows],
        seeds=[r.seed for r in rows],
        prompts=[r.prompt for r in rows],
        outputs=[r.output for r in rows],
    )
    return Sampler([EOS])(logits, metadata).sampled_token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=100, min_p=0.01),
    ],
)
def test_same_seed_and_position_give_same_token_in_any_batch(params: SamplingParams) -> None:
    rng = random.Random(0)
    vocab = 400
    for trial in range(10):
        logits = [rng.gauss(0.0, 1.0) for _ in range(vocab)]
        target = Row(logits, params, seed=1000 + trial, prompt=[1, 2, 3], output=[5] * 7)
        alone = sample_in_batch([target])[0]
        for batch_size in (2, 5, 9):
            others = [random_other_row(rng, vocab) for _ in range(batch_size - 1)]
            where = rng.randrange(batch_size)
            batch = others[:where] + [target] + others[where:]
            assert sample_in_batch(batch)[where] == alone
        # Reversed row order and the target twice in one batch.
        others = [random_other_row(rng, vocab) for _ in range(4)]
        tokens = sample_in_batch([target] + others + [target])
        assert tokens[0] == tokens[-1] == alone


def test_different_seeds_or_positions_give_different_draws() -> None:
    uniform = [0.0] * 1000
    by_seed = sample_many(uniform, SamplingParams(), 100, vary="seed")
    by_position = sample_many(uniform, SamplingParams(), 100, vary="position")
    # 100 uniform draws from 1000 tokens: ~95 distinct values on average.
    assert len(set(by_seed)) > 85
    assert len(set(by_position)) > 85
    # Swapping seed and position is a different stream.
    logits = torch.tensor([uniform] * 50)
    firsts, seconds = list(range(50)), list(range(1, 51))
    params = [SamplingParams()] * 50
    forward = Sampler([EOS])(logits, make_metadata(params, seeds=firsts, positions=seconds))
    swapped = Sampler([EOS])(logits, make_metadata(params, seeds=seconds, positions=firsts))
    same = sum(a == b for a, b in zip(forward.sampled_token_ids, swapped.sampled_token_ids))
    assert same < 5


def test_seed_accepts_negative_and_huge_values() -> None:
    logits = torch.zeros(2, 100)
    metadata = make_metadata([SamplingParams()] * 2, seeds=[-1, 2**70], positions=[0, 10**9])
    first = Sampler([EOS])(logits, metadata).sampled_token_ids
    assert first == Sampler([EOS])(logits, metadata).sampled_token_ids


# --------------------------------------------------------------------------- logprobs


def test_sampled_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.3, top_k=10),
        SamplingParams(temperature=1.7, frequency_penalty=1.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, min_tokens=4),
    ]
    outputs = [[int(logits[0].argmax())], [1], [int(logits[2].argmax())] * 3, []]
    out = Sampler([int(logits[3].argmax())])(logits, make_metadata(params, outputs=outputs))
    raw = torch.log_softmax(logits, dim=-1)
    expected = [raw[i, t].item() for i, t in enumerate(out.sampled_token_ids)]
    assert out.sampled_logprobs == pytest.approx(expected, abs=1e-5)
    # Penalties/min_tokens changed what was sampled, but not the reported logprobs.
    assert out.sampled_token_ids[0] != logits[0].argmax()
    assert out.sampled_token_ids[3] != logits[3].argmax()
    assert out.logprobs == [None, None, None, None]


def check_position_logprobs(entry: dict, raw_row: torch.Tensor, token: int, k: int) -> None:
    """entry holds `token` and the top-k of raw_row, with exact values and ranks."""
    top = raw_row.topk(k).indices.tolist() if k else []
    assert set(entry) == {token, *top}
    assert len(entry) in (k, k + 1)
    assert list(entry)[0] == token
    for token_id, logprob in entry.items():
        assert logprob.logprob == pytest.approx(raw_row[token_id].item(), abs=1e-5)
        assert logprob.rank == 1 + int((raw_row > raw_row[token_id]).sum())
        assert logprob.decoded_token is None


@pytest.mark.parametrize("k", [0, 1, 5])
def test_top_logprobs_have_correct_values_and_ranks(k: int) -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(7))
    params = [
        SamplingParams(temperature=1.0, logprobs=k),
        SamplingParams(temperature=0.0, logprobs=k),
        SamplingParams(),
    ]
    out = Sampler([EOS])(logits, make_metadata(params))
    raw = torch.log_softmax(logits, dim=-1)
    for row in (0, 1):
        entry = out.logprobs[row]
        assert entry is not None
        token = out.sampled_token_ids[row]
        check_position_logprobs(entry, raw[row], token, k)
        assert entry[token].logprob == out.sampled_logprobs[row]
    assert out.logprobs[2] is None


def test_sampled_token_outside_top_k_gives_k_plus_one_entries() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=1, logprobs=1)
    out = Sampler([EOS])(logits, make_metadata([params]))
    entry = out.logprobs[0]
    assert out.sampled_token_ids == [2]
    assert list(entry) == [2, EOS]
    assert [entry[2].rank, entry[EOS].rank] == [2, 1]


def test_tied_logprobs_share_a_rank() -> None:
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0, 1.0]])
    out = Sampler([EOS])(logits, make_metadata([SamplingParams(temperature=0.0, logprobs=4)]))
    ranks = {token: lp.rank for token, lp in out.logprobs[0].items()}
    assert ranks == {0: 1, 1: 1, 2: 3, 4: 3}


def test_logprobs_larger_than_vocab_is_capped() -> None:
    logits = torch.randn(1, 5)
    out = Sampler([EOS])(logits, make_metadata([SamplingParams(logprobs=20)]))
    assert set(out.logprobs[0]) == set(range(5))


@pytest.mark.parametrize("k", [0, 2, 6])
def test_compute_prompt_logprobs_matches_log_softmax(k: int) -> None:
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(8))
    targets = [3, 0, 49, 3, 12, 7, 7]
    result = compute_prompt_logprobs(logits, targets, k)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(result) == len(targets)
    for row, (entry, target) in enumerate(zip(result, targets)):
        check_position_logprobs(entry, raw[row], target, k)


def test_compute_prompt_logprobs_rejects_mismatched_targets() -> None:
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(torch.zeros(3, 10), [1, 2], 1)
    assert compute_prompt_logprobs(torch.zeros(0, 10), [], 2) == []


# --------------------------------------------------------------------------- batch checks


def test_metadata_length_mismatch_raises() -> None:
    metadata = make_metadata([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="one entry per logits row"):
        Sampler([EOS])(torch.zeros(3, 10), metadata)


def test_empty_batch() -> None:
    out = Sampler([EOS])(torch.zeros(0, 10), make_metadata([]))
    assert out.sampled_token_ids == [] and out.sampled_logprobs == [] and out.logprobs == []


# --------------------------------------------------------------------------- property


def allowed_superset(logits: list[float], params: SamplingParams, tol: float = 1e-3) -> set[int]:
    """Tokens the filters may keep (float64 reference, loosened by `tol` at the p boundaries)."""
    vocab = len(logits)
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(vocab), key=lambda i: -scaled[i])
    kept = set(range(vocab))
    if 0 < params.top_k < vocab:
        kth = scaled[order[params.top_k - 1]]
        kept = {i for i in kept if scaled[i] >= kth}
    if params.top_p + tol < 1.0:
        top = max(scaled[i] for i in kept)
        weights = {i: math.exp(scaled[i] - top) for i in kept}
        total = sum(weights.values())
        mass_before = 0.0
        prefix = set()
        for i in (i for i in order if i in kept):
            if mass_before / total >= params.top_p + tol:
                break
            prefix.add(i)
            mass_before += weights[i]
        kept = prefix
    if params.min_p > tol:
        top = max(scaled[i] for i in kept)
        kept = {i for i in kept if math.exp(scaled[i] - top) >= params.min_p - tol}
    return kept


@settings(max_examples=150, deadline=None)
@given(
    # Distinct logits on a 0.5 grid, so float32 and float64 agree on the order.
    raw=st.lists(st.integers(-20, 20), min_size=2, max_size=12, unique=True),
    temperature=st.floats(0.1, 2.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**63 - 1),
    position=st.integers(0, 10_000),
)
def test_sampled_token_is_always_allowed_and_batch_independent(
    raw: list[int],
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int,
    position: int,
) -> None:
    logits = [0.5 * x for x in raw]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    other = SamplingParams(temperature=0.9, top_p=0.5)
    batch = torch.tensor([list(reversed(logits)), logits])
    metadata = make_metadata([other, params], seeds=[seed + 1, seed], positions=[position] * 2)
    token = Sampler([EOS])(batch, metadata).sampled_token_ids[1]
    assert token in allowed_superset(logits, params)
    alone = make_metadata([params], seeds=[seed], positions=[position])
    assert Sampler([EOS])(torch.tensor([logits]), alone).sampled_token_ids == [token]

"""Beam search equals Hugging Face's and shares blocks between hypotheses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.bench.hf_reference import load_hf_model
from pagedllm.config.engine import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.runner_output import ModelRunnerOutput, SampledTokens
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.beam_search import BeamGroup
from pagedllm.outputs import Logprob, RequestMetrics
from tests.conftest import assert_pool_free, hf_model_copy

PROMPTS = [
    "The old lighthouse keeper climbed the stairs",
    "In a distant galaxy, scientists discovered",
    "def add(a, b):",
]


def hf_beam(hf_model, prompt_ids: list[int], params: BeamSearchParams) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=params.beam_width,
        do_sample=False,
        max_new_tokens=params.max_tokens,
        early_stopping=params.early_stopping,
        length_penalty=params.length_penalty,
        num_return_sequences=1,
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    # HF pads a hypothesis that ended early; ours stops at its EOS.
    eos = hf_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


def check_against_hf(llm: LLM, hf_model, params: BeamSearchParams) -> None:
    tokenizer = llm.get_tokenizer()
    outputs = llm.beam_search(PROMPTS, params)
    assert_pool_free(llm)
    with torch.inference_mode():
        for prompt, output in zip(PROMPTS, outputs):
            ids = tokenizer.encode(prompt)
            assert len(output.sequences) == params.beam_width
            scores = [s.score for s in output.sequences]
            assert scores == sorted(scores, reverse=True)
            best = output.sequences[0]
            assert best.tokens[: len(ids)] == ids
            assert best.tokens[len(ids) :] == hf_beam(hf_model, ids, params), prompt


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=4, max_tokens=12),
        BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5, early_stopping=True),
    ],
)
def test_tiny_model_beam_search_matches_hf(tiny_model_dir, params):
    folder = tiny_model_dir("llama")
    check_against_hf(LLM(folder, num_kv_blocks=128, debug_invariants=True), load_hf_model(folder), params)


@pytest.mark.slow
def test_smollm2_beam_search_matches_hf():
    params = BeamSearchParams(beam_width=4, max_tokens=16)
    check_against_hf(LLM(num_kv_blocks=256, debug_invariants=True), hf_model_copy(None), params)


def test_beams_share_prefix_blocks(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompt = {"prompt_token_ids": [(17 * j) % 3000 + 300 for j in range(400)]}
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    shared = LLM(folder, num_kv_blocks=200, debug_invariants=True)
    out = shared.beam_search([prompt], params)[0]
    copied = LLM(folder, num_kv_blocks=200, enable_block_sharing=False)
    assert [s.tokens for s in copied.beam_search([prompt], params)[0].sequences] == [s.tokens for s in out.sequences]
    # 400-token prompt = 25 blocks, stored once; each beam adds at most 2 blocks of its own.
    assert shared.stats()["peak_blocks_in_use"] <= 25 + 4 * 3
    assert copied.stats()["peak_blocks_in_use"] >= 4 * 25
    assert all(len(s.tokens) == 420 for s in out.sequences)
    assert_pool_free(shared)
    assert_pool_free(copied)


def test_beams_are_recomputed_never_swapped_and_keep_their_results(tiny_model_dir):
    folder = tiny_model_dir("llama")
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    roomy = LLM(folder, num_kv_blocks=128)
    expected = [[s.tokens for s in out.sequences] for out in roomy.beam_search(PROMPTS, params)]
    small = LLM(folder, num_kv_blocks=14, block_size=4, preemption_mode="swap", swap_space=0.01,
                debug_invariants=True)
    got = [[s.tokens for s in out.sequences] for out in small.beam_search(PROMPTS, params)]
    assert got == expected
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["swap_out_blocks"] == 0
    assert_pool_free(small)


def test_bad_beam_params_are_value_errors():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="min_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=4, min_tokens=5)


def beam_scheduler(width: int, max_tokens: int, **config) -> tuple[Scheduler, KVCacheManager, BeamGroup]:
    """A scheduler running one beam search over a 6-token prompt, with no model."""
    kv = KVCacheManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, **config), kv)
    group = BeamGroup("r", None, [1, 2, 3, 4, 5, 6], BeamSearchParams(width, max_tokens, ignore_eos=True), [0],
                      RequestMetrics(arrival_time=0.0))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=group.num_candidates)
    scheduler.add_request(Request("r", group.prompt_token_ids, params, [0], max_tokens, num_samples=width,
                                  group_policy=group))
    return scheduler, kv, group


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """Each row's distribution: after token t, t + 1 (logprob -0.1), t + 2 (-0.7), t + 3 (-2.0)."""
    out = scheduler.schedule()
    sampled = {}
    for row in (row for s in out.scheduled for row in s.sample_rows):
        last = scheduler.requests[row.sequence_id].all_token_ids[-1]
        entry = {last + 1: Logprob(-0.1), last + 2: Logprob(-0.7), last + 3: Logprob(-2.0)}
        sampled[row.sequence_id] = SampledTokens([last + 1], [-0.1], [entry])
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    scheduler.check_invariants()
    return out


def test_beam_group_is_the_policy_of_its_beams():
    scheduler, kv, group = beam_scheduler(width=2, max_tokens=3)
    first = scheduler.requests["r"]
    assert group.num_rows(first) == 1 and not group.may_swap and not group.may_speculate
    fake_step(scheduler)  # prefill: the one beam ranks 7 and 8 after the prompt; the second is a fork
    assert scheduler.num_seats_in_use == 2
    assert group.running == pytest.approx({"r": -0.1, "r::beam1": -0.7})
    assert scheduler.requests["r::beam1"].output_token_ids == [8]
    assert kv.get_block_ids("r")[0][0] == kv.get_block_ids("r::beam1")[0][0]  # the prompt's full block is shared
    while not group.done:
        fake_step(scheduler)
    assert not scheduler.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks
    assert [h.output_token_ids for h in group.finished] == [[7, 8, 9], [7, 8, 10]]
    assert group.request_output(tokenizer=_Ids()).outputs[0].token_ids == [7, 8, 9]


def test_a_beam_waits_unscheduled_for_its_siblings_then_the_group_ranks():
    # One token per step: the beams of a group reach their next position in different steps.
    scheduler, _, group = beam_scheduler(width=2, max_tokens=4, max_num_batched_tokens=1)
    while len(group.running) < 2:  # the prompt, a token at a time, then the fork
        fake_step(scheduler)
    first = fake_step(scheduler)
    assert [s.sequence_id for s in first.scheduled] == ["r"]  # the budget left no room for the sibling
    assert set(group.parked) == {"r"} and scheduler.requests["r"].num_output_tokens == 1  # token held back
    second = fake_step(scheduler)
    assert [s.sequence_id for s in second.scheduled] == ["r::beam1"]  # "r" has nothing to compute
    assert not group.parked and all(scheduler.requests[rid].num_output_tokens == 2 for rid in group.running)


class _Ids:
    """A tokenizer stand-in whose text is the token ids."""

    @staticmethod
    def decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, token_ids))


def test_a_parked_beam_preempted_is_ranked_only_after_its_recompute_samples_again():
    """A parked beam that is preempted and resumed has no usable distribution
    while its recompute runs: a sibling's row must not rank the group then (the
    recompute's row, for a position already decided, would rank the next step
    with a stale distribution: repeated tokens)."""
    expected_scheduler, _, expected = beam_scheduler(width=2, max_tokens=6)
    for _ in range(50):
        if expected.done:
            break
        fake_step(expected_scheduler)
    scheduler, kv, group = beam_scheduler(width=2, max_tokens=6, max_num_batched_tokens=1)
    for _ in range(50):  # one token per step: "r" parks while its sibling waits for budget
        if len(group.running) == 2 and "r" in group.parked:
            break
        fake_step(scheduler)
    assert "r" in group.parked
    parked = scheduler.requests["r"]
    scheduler.running.remove(parked)
    scheduler._preempt(parked, SchedulerOutput())
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=4)
    resumed = fake_step(scheduler)  # the sibling samples while "r" recomputes part of its tokens
    assert {s.sequence_id for s in resumed.scheduled} == {"r", "r::beam1"}
    assert parked.num_computed_tokens < parked.num_tokens and "r" not in group.parked
    for _ in range(50):
        if group.done:
            break
        fake_step(scheduler)
    assert [h.output_token_ids for h in group.finished] == [h.output_token_ids for h in expected.finished]
    assert not scheduler.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks

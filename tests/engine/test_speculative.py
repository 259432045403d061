"""Speculative decoding (n-gram prompt lookup) through the engine: greedy
output is exactly the output without it, whatever else is on (stop strings,
logprobs, parallel samples, preemption, prefix caching), and the pool ends free."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import build_parser
from tests.conftest import assert_pool_free

# "always": every match is drafted, so the paths under test (rollback, preemption of
# drafted sequences) run whatever this machine's row cost makes the adaptive policy do.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "draft_policy": "always"}


def repetitive_prompts(num: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase, so lookups find matches (and the tiny
    random model tends to loop, which they also catch)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(300, 4000) for _ in range(rng.randint(3, 8))]
        noise = [rng.randrange(300, 4000) for _ in range(rng.randint(0, 10))]
        prompts.append({"prompt_token_ids": noise + phrase * rng.randint(2, 5)})
    return prompts


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=512)


def test_greedy_output_is_unchanged_and_drafts_are_accepted(tiny_llama, reference):
    prompts = repetitive_prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = reference.generate(prompts, params)
    llm = LLM(tiny_llama, num_kv_blocks=512, speculative_config=NGRAM, debug_invariants=True)
    got = llm.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] > 0 and stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]
    # Fewer steps than tokens: some steps yielded several.
    assert stats["num_steps"] < sum(len(o.outputs[0].token_ids) for o in got)
    assert_pool_free(llm)


def test_the_runner_returns_one_token_list_per_sample_row(tiny_llama, monkeypatch):
    """Every step: one SampledTokens per sample row, its three lists of one
    length; one token for a row without drafts, the accepted drafts then one
    for a speculating sequence."""
    llm = LLM(tiny_llama, num_kv_blocks=512, speculative_config=NGRAM)
    runner = llm.llm_engine.runner
    execute = runner.execute
    lengths = []

    def checked(scheduler_output, grammar=None):
        output = execute(scheduler_output, grammar)
        rows = {row.sequence_id for s in scheduler_output.scheduled for row in s.sample_rows}
        assert set(output.sampled) == rows
        for scheduled in scheduler_output.scheduled:
            for row in scheduled.sample_rows:
                tokens = output.sampled[row.sequence_id]
                assert len(tokens.token_ids) == len(tokens.logprobs) == len(tokens.position_logprobs)
                drafts = scheduled.draft_token_ids
                assert 1 <= len(tokens.token_ids) <= len(drafts) + 1
                assert tokens.token_ids[:-1] == drafts[: len(tokens.token_ids) - 1]
                lengths.append(len(tokens.token_ids))
        return output

    monkeypatch.setattr(runner, "execute", checked)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    outputs = llm.generate(repetitive_prompts(12), params)
    assert max(lengths) > 1  # some step accepted drafts
    assert all(len(o.outputs[0].logprobs) == 48 for o in outputs)
    assert_pool_free(llm)


def test_the_adaptive_draft_policy_keeps_greedy_output(tiny_llama, reference):
    """The default policy withholds drafts where they do not pay; which ones
    depends on this machine's timings, the output never does."""
    prompts = repetitive_prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    adaptive = {key: value for key, value in NGRAM.items() if key != "draft_policy"}
    llm = LLM(tiny_llama, num_kv_blocks=512, speculative_config=adaptive, debug_invariants=True)
    assert token_ids(llm.generate(prompts, params)) == token_ids(reference.generate(prompts, params))
    assert llm.stats()["spec_num_draft_tokens"] > 0  # the first drafts go out before any cost is known
    assert_pool_free(llm)


def test_stop_strings_logprobs_and_samples_match_the_plain_engine(tiny_llama, reference):
    prompts = repetitive_prompts(6, seed=1)
    probe = reference.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stop = probe[0].outputs[0].text[10:14]  # a stop string the first request meets mid-output
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=20, n=2, best_of=2),
        SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[probe[0].outputs[0].token_ids[7]]),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    expected = reference.generate(prompts, params)
    llm = LLM(tiny_llama, num_kv_blocks=512, speculative_config=NGRAM, debug_invariants=True)
    got = llm.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    for g, e in zip(got, expected):
        for gc, ec in zip(g.outputs, e.outputs):
            assert (gc.text, gc.finish_reason, gc.stop_reason) == (ec.text, ec.finish_reason, ec.stop_reason)
            assert gc.cumulative_logprob == pytest.approx(ec.cumulative_logprob, abs=1e-3)
    assert got[0].outputs[0].stop_reason == stop
    for g, e in zip(got[1].outputs[0].logprobs, expected[1].outputs[0].logprobs):
        assert g.keys() == e.keys()
        assert [x.logprob for x in g.values()] == pytest.approx([x.logprob for x in e.values()], abs=1e-4)
    assert_pool_free(llm)


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_preemption_and_rollback_in_a_small_pool(tiny_llama, reference, mode):
    prompts = repetitive_prompts(16, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = reference.generate(prompts, params)
    llm = LLM(tiny_llama, num_kv_blocks=30, preemption_mode=mode, swap_space=0.01, speculative_config=NGRAM,
              debug_invariants=True)
    got = llm.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert_pool_free(llm)


def test_seeded_sampling_is_reproducible_with_speculation(tiny_llama):
    prompts = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11, ignore_eos=True)
    llm = LLM(tiny_llama, num_kv_blocks=256, speculative_config=NGRAM)
    first = token_ids(llm.generate(prompts, params))
    assert token_ids(llm.generate(prompts, params)) == first
    assert all(len(o[0]) == 32 for o in first)
    assert_pool_free(llm)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"lookahead": 3}, "unknown key"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config_is_refused_with_the_key_named(tiny_llama, option, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, speculative_config=option)


def test_the_command_line_takes_vllm_s_json_flag():
    args = build_parser().parse_args(["generate", "hi", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}

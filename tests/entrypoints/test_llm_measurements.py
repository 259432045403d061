"""What ``LLM`` offers the benchmarks to measure with: a fresh peak of blocks in
use, the step-time split, the counters in ``stats()`` and the weights' bytes."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free

PHASES = ["bookkeeping", "input preparation", "forward", "sampling"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def pool_is_free_afterwards(llm):
    yield
    assert_pool_free(llm)


def prompts(count: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % 3000 + 200 for j in range(length)]} for i in range(count)]


def run(llm, count: int, length: int) -> None:
    llm.generate(prompts(count, length), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)


def test_reset_peak_blocks_in_use_measures_the_next_workload_alone(llm):
    run(llm, count=6, length=100)  # 6 x 104 tokens: 7 blocks each
    assert llm.stats()["peak_blocks_in_use"] >= 6 * 7
    llm.reset_peak_blocks_in_use()
    assert llm.stats()["peak_blocks_in_use"] == 0  # nothing in use now
    run(llm, count=1, length=30)  # 34 tokens: 3 blocks
    assert llm.stats()["peak_blocks_in_use"] == 3


def test_step_timings_cover_the_steps_since_the_last_reset(llm):
    run(llm, count=2, length=20)
    llm.reset_step_timings()
    assert llm.step_timings() == dict.fromkeys(PHASES, 0.0)
    run(llm, count=2, length=20)
    timings = llm.step_timings()
    assert list(timings) == PHASES
    assert timings["forward"] > 0 and all(seconds >= 0 for seconds in timings.values())
    timings["forward"] = -1.0  # a copy: the engine's own counters are untouched
    assert llm.step_timings()["forward"] > 0


def test_stats_count_the_sequences_scheduled_over_all_steps(llm):
    before = llm.stats()
    run(llm, count=3, length=10)  # one prefill step of 3, then 3 decode steps of 3
    after = llm.stats()
    assert after["num_steps"] - before["num_steps"] == 4
    assert after["num_scheduled_sequences"] - before["num_scheduled_sequences"] == 3 * 4
    assert after["mean_running_per_step"] == after["num_scheduled_sequences"] / after["num_steps"]


def test_weight_bytes_counts_every_parameter_once(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    config = hf_model.config
    assert config.tie_word_embeddings  # the embedding doubles as the LM head: it must count once
    float32_bytes = 4 * sum(p.numel() for p in hf_model.parameters())
    embedding_bytes = 4 * config.vocab_size * config.hidden_size
    assert float32_bytes <= llm.weight_bytes() < float32_bytes + embedding_bytes

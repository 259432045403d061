"""Engine behaviour on a tiny random Llama: stops, seeds, bad input, abort,
block sizes, chunking and preemption. Every test ends with an all-free pool."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, max_model_len=512, debug_invariants=True)


@pytest.fixture(autouse=True)
def pool_is_free_afterwards(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_free(request.getfixturevalue("llm"))


def token_prompts(count: int, length: int, offset: int = 0) -> list[dict]:
    return [{"prompt_token_ids": [(offset + 37 * i + 11 * j) % 5000 + 200 for j in range(length)]} for i in range(count)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_max_tokens_gives_length_finish(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length"
    assert out.finished
    assert out.prompt == "Hello there"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello there")
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_stop_token_ids_and_stop_strings(llm):
    prompt = token_prompts(1, 12)[0]
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt, dataclasses.replace(GREEDY, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    out = llm.generate(prompt, dataclasses.replace(GREEDY, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = llm.generate(prompt, dataclasses.replace(GREEDY, stop=stop, include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == text[: cut + len(stop)]


def test_min_tokens_holds_back_stop_tokens(llm):
    prompt = token_prompts(1, 12)[0]
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[0]
    params = dataclasses.replace(GREEDY, stop_token_ids=[stop_id], min_tokens=4, max_tokens=4)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids and len(out.token_ids) == 4


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=1234)
    prompt = token_prompts(1, 10)[0]
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = token_prompts(5, 30, offset=99)
    batch = [others[0], others[1], prompt, others[2], others[3]]
    batch_params = [SamplingParams(temperature=0.7, max_tokens=30, seed=i) for i in range(5)]
    batch_params[2] = params
    together = llm.generate(batch, batch_params, use_tqdm=False)[2].outputs[0].token_ids
    assert together == alone
    other_seed = llm.generate(prompt, dataclasses.replace(params, seed=4321), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_logprobs_are_reported_for_every_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    completion = llm.generate(token_prompts(1, 9)[0], params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == 6
    total = 0.0
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and len(entry) >= 3
        assert entry[token_id].rank == 1  # greedy takes the most likely token
        assert entry[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
        total += entry[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, -1], "outside the vocabulary"),
        ([1, 2, 10**9], "outside the vocabulary"),
        ([5] * 512, "max_model_len"),
        ({"prompt": 5}, "prompt_token_ids"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": []}}, "takes text only"),
    ],
)
def test_bad_prompts_raise_and_running_requests_carry_on(llm, prompt, message):
    engine = llm.llm_engine
    good = token_prompts(1, 20)[0]
    expected = llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", good, GREEDY)
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["good"]
    assert finished["good"].outputs[0].token_ids == expected


def test_request_that_cannot_fit_in_the_pool_is_rejected(tiny_llama):
    small = LLM(tiny_llama, num_kv_blocks=8, block_size=16, max_model_len=512)  # 128 token slots
    with pytest.raises(ValueError, match="needs 13 KV blocks but the whole pool has 8"):
        small.generate({"prompt_token_ids": [7] * 100}, SamplingParams(max_tokens=100), use_tqdm=False)
    assert_pool_free(small)


def test_a_bad_prompt_in_a_batch_runs_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["fine"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="already in use"):
        llm.llm_engine.add_request("dup", "hi", GREEDY)
        llm.llm_engine.add_request("dup", "hi", GREEDY)
    llm.llm_engine.abort_request("dup")


def test_abort_frees_blocks_mid_generation(llm):
    engine = llm.llm_engine
    for i, prompt in enumerate(token_prompts(3, 40)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        engine.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_blocks"]
    engine.abort_request("r1")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"r0", "r2"}


def test_step_api_streams_one_token_at_a_time(llm):
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": [300, 301, 302]}, SamplingParams(temperature=0, max_tokens=4))
    lengths, flags = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
            flags.append(out.finished)
    assert lengths == [1, 2, 3, 4]
    assert flags == [False, False, False, True]


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi!"}], GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nHi!<|im_end|>" in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) > 0


def test_stats_report_the_pool(llm):
    stats = llm.stats()
    for key in ("num_blocks", "block_size", "num_free_blocks", "peak_blocks_in_use", "num_running",
                "num_waiting", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert key in stats
    assert stats["num_blocks"] == 64 and stats["block_size"] == 16
    assert 0 < stats["peak_blocks_in_use"] <= 64


def test_block_size_chunking_and_preemption_do_not_change_greedy_output(tiny_llama, llm):
    prompts = token_prompts(6, 45)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    variants = {
        "block_size=1": dict(block_size=1, num_kv_blocks=1024),
        "block_size=64": dict(block_size=64, num_kv_blocks=16),
        "chunked prefill of 16 tokens": dict(num_kv_blocks=64, max_num_batched_tokens=16),
        "2 sequences at a time": dict(num_kv_blocks=64, max_num_seqs=2),
        # 6 requests x 85 tokens need 36 blocks of 16; 12 blocks force preemption.
        "tiny pool": dict(num_kv_blocks=12),
    }
    for name, kwargs in variants.items():
        other = LLM(tiny_llama, max_model_len=512, debug_invariants=True, **kwargs)
        assert token_ids(other.generate(prompts, params, use_tqdm=False)) == expected, name
        stats = other.stats()
        if name == "tiny pool":
            assert stats["num_preemptions"] > 0
        bs = stats["block_size"]
        assert stats["peak_blocks_in_use"] <= min(stats["num_blocks"], 6 * math.ceil(85 / bs))
        assert_pool_free(other)


def test_pool_is_sized_from_the_memory_budget(tiny_llama, caplog):
    import logging

    probe = LLM(tiny_llama, num_kv_blocks=4)
    per_token = probe.stats()["bytes_per_token"]
    # 2 (K, V) x 2 layers x 2 KV heads x 16 head dim x 4 bytes
    assert per_token == 2 * 2 * 2 * 16 * 4
    budget = per_token * 16 * 37 + 5
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        sized = LLM(tiny_llama, kv_cache_memory=budget)
    assert sized.stats()["num_blocks"] == 37
    assert any("KV cache: 37 blocks x 16 tokens = 592 tokens" in r.getMessage() for r in caplog.records)
    fraction = LLM(tiny_llama, kv_cache_fraction=0.001, max_model_len=256)
    assert fraction.stats()["num_blocks"] >= 1
    with pytest.raises(ValueError, match="holds no block"):
        LLM(tiny_llama, kv_cache_memory=per_token)
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        LLM(tiny_llama, kv_cache_fraction=1.5)


def test_bfloat16_runs_with_a_bfloat16_pool(tiny_llama):
    import torch

    llm_bf16 = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=32, debug_invariants=True)
    assert llm_bf16.llm_engine.runner.kv_caches[0].key.dtype == torch.bfloat16
    assert llm_bf16.stats()["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    out = llm_bf16.generate(token_prompts(3, 20), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert_pool_free(llm_bf16)

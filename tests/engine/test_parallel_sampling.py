"""Parallel sampling shares the prompt's blocks; copy-on-write keeps samples apart."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free


def long_prompt(length: int) -> dict:
    return {"prompt_token_ids": [(31 * j) % 4000 + 300 for j in range(length)]}


def test_n4_on_a_2000_token_prompt_stores_the_prompt_once(tiny_llama):
    params = SamplingParams(n=4, temperature=0.0, max_tokens=32)
    shared = LLM(tiny_llama, num_kv_blocks=700, max_model_len=4096, debug_invariants=True)
    outputs = shared.generate(long_prompt(2000), params, use_tqdm=False)[0].outputs
    peak = shared.stats()["peak_blocks_in_use"]
    assert peak <= math.ceil(2000 / 16) + 4 * 3 + 4
    # Greedy: all four samples are the n=1 greedy output.
    single = shared.generate(long_prompt(2000), SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [single[0].outputs[0].token_ids] * 4
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert_pool_free(shared)

    copied = LLM(tiny_llama, num_kv_blocks=700, max_model_len=4096, enable_block_sharing=False)
    assert [o.token_ids for o in copied.generate(long_prompt(2000), params, use_tqdm=False)[0].outputs] == [
        o.token_ids for o in outputs
    ]
    assert copied.stats()["peak_blocks_in_use"] >= 4 * math.ceil(2000 / 16)
    assert_pool_free(copied)


def test_seeded_samples_differ_and_are_reproducible(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128, debug_invariants=True)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7)
    first = [o.token_ids for o in llm.generate(long_prompt(21), params, use_tqdm=False)[0].outputs]
    again = [o.token_ids for o in llm.generate(long_prompt(21), params, use_tqdm=False)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    # Sample 0 is the request's own seed: the same as n=1 with that seed.
    single = llm.generate(long_prompt(21), SamplingParams(temperature=1.0, max_tokens=12, seed=7), use_tqdm=False)
    assert first[0] == single[0].outputs[0].token_ids
    assert_pool_free(llm)


def test_best_of_returns_the_most_likely_samples(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128, debug_invariants=True)
    all_four = llm.generate(long_prompt(10), SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=11), use_tqdm=False)
    best = llm.generate(
        long_prompt(10), SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=8, seed=11), use_tqdm=False
    )[0].outputs
    ranked = sorted(all_four[0].outputs, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    assert_pool_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_copy_on_write_copies_the_shared_tail_exactly(tiny_llama, kv_cache_dtype):
    """Prompt of 20 tokens: block 1 holds 4 prompt tokens and is shared by both
    samples after the fork. The first decode copies it; both sequences then
    read identical prompt K/V from different blocks, and the original is
    untouched. With an int8 pool the scales are copied with the block, bit for bit."""
    llm = LLM(tiny_llama, num_kv_blocks=32, debug_invariants=True, kv_cache_dtype=kv_cache_dtype)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    engine.add_request("r", long_prompt(20), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6))
    engine.step()  # prefill, then fork into "r" and "r::1"
    table = kv.get_block_ids("r")[0]
    assert kv.get_block_ids("r::1")[0] == table and kv.block_pool.blocks[table[1]].ref_cnt == 2
    tail = table[1]
    before = [[t[tail].clone() for t in layer.tensors()] for layer in engine.runner.kv_caches]
    assert len(before[0]) == (4 if kv_cache_dtype == "int8" else 2)
    engine.step()  # both decode: exactly one copy-on-write
    tables = {rid: kv.get_block_ids(rid)[0] for rid in ("r", "r::1")}
    assert tables["r"][0] == tables["r::1"][0]  # the full block stays shared
    copy = tables["r"][1] if tables["r"][1] != tail else tables["r::1"][1]
    assert {tables["r"][1], tables["r::1"][1]} == {tail, copy}
    for layer, originals in zip(engine.runner.kv_caches, before):
        for tensor, original in zip(layer.tensors(), originals):
            for block in (tail, copy):
                assert torch.equal(tensor[block, :4], original[:4])
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(llm)


def test_sharing_does_not_change_sampled_text(tiny_llama):
    params = [SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=20, seed=s) for s in range(3)]
    prompts = [long_prompt(n) for n in (5, 16, 37)]
    results = []
    for sharing in (True, False):
        llm = LLM(tiny_llama, num_kv_blocks=256, enable_block_sharing=sharing, debug_invariants=True)
        results.append([[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params, use_tqdm=False)])
        assert_pool_free(llm)
    assert results[0] == results[1]


def test_abort_frees_every_sample(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, debug_invariants=True)
    engine = llm.llm_engine
    engine.add_request("g", long_prompt(30), SamplingParams(n=3, temperature=1.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.get_num_unfinished_requests() == 1  # user requests, as in vLLM
    assert sorted(engine.scheduler.requests) == ["g", "g::1", "g::2"]  # its three samples run
    engine.abort_request("g")
    assert not engine.has_unfinished_requests()
    assert_pool_free(llm)

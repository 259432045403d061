"""Automatic prefix caching: same outputs, exact hit accounting, tenant isolation."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def tokens(length: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * j) % 4000 + 300 for j in range(length)]


def run(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_outputs_are_identical_with_caching_on_and_off(tiny_llama):
    system = tokens(2050)
    prompts = [
        system + tokens(40, seed=1),
        system + tokens(7, seed=2),
        system,                      # fully cached once the first ran: its 2-token edge is recomputed
        system + tokens(40, seed=1),  # fully cached, block-aligned up to the last block
        tokens(100, seed=3),
    ]
    cached = LLM(tiny_llama, num_kv_blocks=400, max_model_len=4096, debug_invariants=True)
    plain = LLM(tiny_llama, num_kv_blocks=400, max_model_len=4096, enable_prefix_caching=False)
    # One at a time, so each prompt sees what the previous ones left in the cache.
    for prompt in prompts:
        got = run(cached, [prompt])[0]
        assert got.outputs[0].token_ids == run(plain, [prompt])[0].outputs[0].token_ids
    # 2,050 shared tokens = 128 full blocks reused, the 2-token edge recomputed.
    assert run(cached, [system + tokens(5, seed=9)])[0].num_cached_tokens == 128 * 16
    assert plain.stats()["prefix_cache_hits"] == 0
    assert_pool_free(cached)
    # All at once: later requests of the same step hit blocks that this very pass writes.
    together = run(cached, prompts)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in run(plain, prompts)]
    # Prompt 0 computes the shared blocks; 1 and 2 reuse 128 of them, 3 (= prompt 0) 130.
    assert [o.num_cached_tokens for o in together] == [0, 2048, 2048, 2080, 0]
    assert_pool_free(cached)
    assert_pool_free(plain)


def test_outputs_survive_eviction_under_a_small_pool(tiny_llama):
    prompts = [tokens(60, seed=s % 3) + tokens(20, seed=10 + s) for s in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    small = LLM(tiny_llama, num_kv_blocks=16, debug_invariants=True)
    plain = LLM(tiny_llama, num_kv_blocks=64, enable_prefix_caching=False)
    for _ in range(2):  # the second round hits blocks that survived, and recomputes evicted ones
        assert [o.outputs[0].token_ids for o in run(small, prompts, params)] == [
            o.outputs[0].token_ids for o in run(plain, prompts, params)
        ]
    assert small.llm_engine.kv_cache_manager.block_pool.num_evictions > 0
    assert small.stats()["prefix_cache_hits"] > 0
    assert_pool_free(small)
    assert_pool_free(plain)


def test_hit_accounting_is_block_aligned(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128, debug_invariants=True)
    prefix = tokens(512)
    first = run(llm, [prefix + tokens(30, seed=1)])[0]
    second = run(llm, [prefix + tokens(30, seed=2)])[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 512)
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 2 * 542
    assert stats["prefix_cache_hits"] == 512
    assert stats["min_cacheable_prefix_tokens"] == 16
    # Differing in token 0 breaks the whole chain.
    other = [prefix[0] + 1] + prefix[1:] + tokens(30, seed=2)
    assert run(llm, [other])[0].num_cached_tokens == 0
    # A shared prefix shorter than one block gets no hit.
    short = tokens(15, seed=5)
    run(llm, [short + [7, 8, 9]])
    assert run(llm, [short + [10, 11]])[0].num_cached_tokens == 0
    assert_pool_free(llm)


def test_different_salts_never_share(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128, debug_invariants=True)
    prompt = tokens(100)
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY, use_tqdm=False)
    as_bob = llm.generate({"prompt_token_ids": prompt, "cache_salt": "bob"}, GREEDY, use_tqdm=False)[0]
    as_alice = llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY, use_tqdm=False)[0]
    unsalted = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert (as_bob.num_cached_tokens, as_alice.num_cached_tokens, unsalted.num_cached_tokens) == (0, 96, 0)
    assert as_bob.outputs[0].token_ids == as_alice.outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False, cache_salt="carol")
    again = llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False, cache_salt="dave")
    assert again[0].num_cached_tokens == 0 and chat[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, GREEDY, use_tqdm=False)
    assert_pool_free(llm)


def test_reset_prefix_cache_drops_cached_blocks(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    run(llm, [tokens(80)])
    assert llm.stats()["num_cached_blocks"] == 5
    assert llm.reset_prefix_cache() == 5
    assert run(llm, [tokens(80)])[0].num_cached_tokens == 0
    assert_pool_free(llm)


def test_a_failed_step_aborts_its_requests_and_drops_the_cache(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    run(llm, [tokens(40)])
    assert llm.stats()["num_cached_blocks"] > 0

    def broken(scheduler_output, grammar=None):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(llm.llm_engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device fell over"):
        run(llm, [tokens(40), tokens(50, seed=4)])
    assert llm.stats()["num_cached_blocks"] == 0
    monkeypatch.undo()
    assert_pool_free(llm)
    assert len(run(llm, [tokens(40)])[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert_pool_free(llm)


def test_prompt_logprobs_requests_skip_the_cache_and_get_every_position(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, debug_invariants=True)
    prompt = tokens(70)
    run(llm, [prompt])  # caches the prompt's 4 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    first, second = run(llm, [prompt], params)[0], run(llm, [prompt], params)[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert first.prompt_logprobs[0] is None and all(e is not None for e in first.prompt_logprobs[1:])
    assert [{t: lp.logprob for t, lp in e.items()} for e in first.prompt_logprobs[1:]] == \
        [{t: lp.logprob for t, lp in e.items()} for e in second.prompt_logprobs[1:]]
    # Without prompt logprobs the same prompt still hits.
    assert run(llm, [prompt])[0].num_cached_tokens == 64
    assert_pool_free(llm)

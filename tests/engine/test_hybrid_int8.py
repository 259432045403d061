"""int8 KV with its full-precision tails under a hybrid KV layout (issue 55): tiny random Gemma 2
and Gemma 3 (sliding layers, window 8) with the hybrid manager give the same greedy tokens, and
cumulative logprobs within rounding, as the same model's int8 run with one group
(``disable_hybrid_kv_cache_manager``), prefix-cache hits included; the pool and every tail slot
come back. int8 is not Hugging Face-exact, so that one-group run is the oracle; both also agree
with Hugging Face's fp32 greedy on most tokens.

The prompts, chunking and blocks are ``test_hybrid_kv_oracle``'s: windows cross block boundaries,
blocks fall behind them, prefill chunks end inside blocks (tails handed on)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.engine.test_hybrid_kv_oracle import NEW_TOKENS, PROMPT_LENGTHS, SHARED
from tests.engine.test_int8_tails import assert_same, assert_tails_free, results
from tests.engine.test_sliding_window import hf_greedy, prompts

# min_tokens == max_tokens masks EOS exactly as HF's min_new_tokens does.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)


def _llm(folder: str, disable_hybrid: bool, **kwargs) -> LLM:
    # 128 blocks, and two running sequences' fp32 tails: 4 blocks per group, and Gemma 3's
    # tiny layout has 6 groups (one layer each), so the shared prefix stays cached.
    kwargs.setdefault("num_kv_blocks", 176)
    return LLM(folder, kv_cache_dtype="int8", block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=7,
               disable_hybrid_kv_cache_manager=disable_hybrid, debug_invariants=True, **kwargs)


def _run(folder: str, disable_hybrid: bool) -> tuple[list[tuple[list[int], float]], list[list[int]], int]:
    """(results, prompts, the shared-prefix request's cached tokens) of the oracle's prompts,
    then of one sharing a long prefix with the second, run after them."""
    llm = _llm(folder, disable_hybrid)
    assert llm.llm_engine.scheduler_config.kv_groups.is_hybrid != disable_hybrid
    batch = prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
    shared = batch[1][:SHARED] + batch[0][:9]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False)
    assert_tails_free(llm)
    return results(outputs), [*batch, shared], outputs[-1].num_cached_tokens


@pytest.mark.slow  # ~25 s each on a 2-core CPU: two engines and Hugging Face's generate
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_int8_hybrid_matches_the_one_group_int8_run(tiny_gemma_dir, arch):  # noqa: F811
    folder, hf_model = tiny_gemma_dir(arch)
    hybrid, batch, cached = _run(folder, disable_hybrid=False)
    one_group, _, one_group_cached = _run(folder, disable_hybrid=True)
    assert_same(hybrid, one_group)
    window = hf_model.config.sliding_window
    assert window < cached <= SHARED and window < one_group_cached <= SHARED
    agree = sum(a == b for (tokens, _), prompt in zip(hybrid, batch)
                for a, b in zip(tokens, hf_greedy(hf_model, prompt, NEW_TOKENS)))
    assert agree >= 0.8 * NEW_TOKENS * len(batch)


@pytest.mark.slow  # ~20 s: two engines
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_int8_hybrid_preemption_changes_nothing(tiny_gemma_dir, preemption_mode):  # noqa: F811
    """A pool too small for both prompts at once: preempted (swapped: their tails go to the
    host and back with their blocks) and resumed, the tokens and logprobs are the one-group run's."""
    folder, _ = tiny_gemma_dir("gemma2")
    batch = prompts(_llm(folder, False).get_tokenizer(), PROMPT_LENGTHS)
    requests = [{"prompt_token_ids": p} for p in batch]
    # 44 blocks: each request also holds a 4-block fp32 tail per group (2 groups) while it writes.
    small = _llm(folder, False, num_kv_blocks=44, preemption_mode=preemption_mode)
    got = results(small.generate(requests, GREEDY, use_tqdm=False))
    stats = small.stats()
    assert stats["num_preemptions"] > 0, stats
    assert preemption_mode == "recompute" or stats["swap_out_blocks"] > 0
    assert_tails_free(small)
    assert_same(got, results(_llm(folder, True).generate(requests, GREEDY, use_tqdm=False)))


@pytest.mark.slow  # ~10 s: two engines
def test_int8_hybrid_without_tails_in_a_pool_too_small_for_them(tiny_gemma_dir):  # noqa: F811
    """11 blocks: one request's tails (one per group, 2 groups: 8 blocks) would leave it
    3 blocks, no more than the fp32 pool of the same memory holds, so the plan keeps none; two
    20-token requests (5 full-attention blocks and 3 inside the window each) preempt
    each other, and the tokens are a roomy tail-less hybrid run's."""
    folder, _ = tiny_gemma_dir("gemma2")
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)
    small = _llm(folder, False, num_kv_blocks=11)
    requests = [{"prompt_token_ids": p} for p in prompts(small.get_tokenizer(), [12, 12])]
    assert small.llm_engine.pool_plan.tail_run_blocks == 0 and small.llm_engine.runner.tail_slots is None
    got = results(small.generate(requests, params, use_tqdm=False))
    assert small.stats()["num_preemptions"] > 0
    assert_pool_free(small)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pagedllm.worker.memory.tails_pay", lambda *args: False)
        roomy = _llm(folder, False)
    assert_same(got, results(roomy.generate(requests, params, use_tqdm=False)))
    assert_pool_free(roomy)

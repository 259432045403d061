"""The engine with a quantized KV pool: capacity, scales through swap and the
prefix cache, bad values, and SmolLM2's greedy output against fp32 KV."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.engine.test_engine_behaviour import token_ids, token_prompts


def test_int8_pool_holds_more_tokens_in_the_same_memory(tiny_llama, caplog):
    memory = 1 << 20
    auto = LLM(tiny_llama, kv_cache_memory=memory)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        int8 = LLM(tiny_llama, kv_cache_memory=memory, kv_cache_dtype="int8")
    # The tiny model: head_dim 16, so int8 + an fp32 scale is 20 bytes per vector vs 64 in fp32.
    assert auto.stats()["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert int8.stats()["bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert int8.stats()["num_blocks"] == memory // (16 * 2 * 2 * 2 * 20)
    assert int8.stats()["num_blocks"] >= 3 * auto.stats()["num_blocks"]
    assert any("int8 KV with per-token scales" in r.getMessage() and "3.20x the tokens of a float32 pool"
               in r.getMessage() for r in caplog.records)
    out = int8.generate(token_prompts(4, 30), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert_pool_free(int8)


def test_bad_kv_cache_dtype_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3"):
        LLM(tiny_llama, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_swapped_blocks_come_back_with_their_scales(tiny_llama, kv_cache_dtype):
    """Swap restores a block's values and scales byte for byte, so a run that
    swaps gives the same greedy tokens as one that never preempts."""
    prompts = token_prompts(6, 60)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    roomy = LLM(tiny_llama, num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype, debug_invariants=True)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    tight = LLM(tiny_llama, num_kv_blocks=14, kv_cache_dtype=kv_cache_dtype, preemption_mode="swap",
                debug_invariants=True)
    assert token_ids(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert tight.stats()["swap_out_blocks"] > 0 and tight.stats()["swap_in_blocks"] > 0
    assert_pool_free(roomy)
    assert_pool_free(tight)


def test_swap_pool_round_trip_is_exact_for_every_tensor(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=8, kv_cache_dtype="int8", preemption_mode="swap", swap_space=0.001)
    runner = llm.llm_engine.runner
    torch.manual_seed(0)
    for layer in runner.kv_caches:
        for tensor in layer.tensors():
            tensor.copy_(torch.randint(-100, 100, tensor.shape).to(tensor.dtype) if tensor.dtype == torch.int8
                         else torch.rand(tensor.shape))
    saved = [[t[3].clone() for t in layer.tensors()] for layer in runner.kv_caches]
    runner.swap_pool.swap_out(runner.kv_caches, [(3, 0)])
    for layer in runner.kv_caches:
        for tensor in layer.tensors():
            tensor[3] = 0
    runner.swap_pool.swap_in(runner.kv_caches, [(0, 5)])
    for layer, originals in zip(runner.kv_caches, saved):
        assert len(layer.tensors()) == 4
        for tensor, original in zip(layer.tensors(), originals):
            assert torch.equal(tensor[5], original)


def test_prefix_cache_hit_reads_the_same_bytes_a_recompute_writes(tiny_llama):
    """Identical tokens give identical quantized bytes and scales, and every
    attention reads what the pool holds, so a prefix-cache hit changes nothing."""
    prefix = token_prompts(1, 48)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": prefix + [900 + i, 901 + i, 902 + i]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cached = LLM(tiny_llama, num_kv_blocks=64, kv_cache_dtype="int8", debug_invariants=True)
    cached.generate(prompts[0], params, use_tqdm=False)  # fills the cache with the 3 prefix blocks
    hits = cached.generate(prompts[1:], params, use_tqdm=False)
    assert all(o.num_cached_tokens == 48 for o in hits)
    fresh = LLM(tiny_llama, num_kv_blocks=64, kv_cache_dtype="int8", enable_prefix_caching=False,
                debug_invariants=True)
    assert token_ids(hits) == token_ids(fresh.generate(prompts[1:], params, use_tqdm=False))
    # The cached prefix blocks hold exactly what a fresh engine writes for the same tokens.
    probe_blocks = []
    for llm in (cached, fresh):
        engine = llm.llm_engine
        engine.add_request("probe", prompts[0], SamplingParams(temperature=0, max_tokens=2))
        engine.step()  # the cached engine finds the prefix; the fresh one computes it
        probe_blocks.append(engine.kv_cache_manager.get_block_ids("probe")[:3])
        while engine.has_unfinished_requests():
            engine.step()
    for cached_layer, fresh_layer in zip(cached.llm_engine.runner.kv_caches, fresh.llm_engine.runner.kv_caches):
        for a, b in zip(cached_layer.tensors(), fresh_layer.tensors()):
            assert torch.equal(a[probe_blocks[0]], b[probe_blocks[1]])
    assert_pool_free(cached)
    assert_pool_free(fresh)


QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How many days are in a week?",
    "What is 12 times 12?", "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "List the planets of the solar system.", "What is photosynthesis?", "Translate 'good morning' into Spanish.",
    "What is the largest ocean on Earth?", "Explain what a noun is.", "How many legs does a spider have?",
    "What is the chemical symbol for gold?", "Give me a synonym for happy.", "What does a CPU do?",
    "Why is the sky blue?",
]


def _greedy_choices(llm: LLM, contexts: list[list[int]], first: list[int]) -> list[list[tuple[int, float]]]:
    """Teacher-forced: for each context, the greedy token (and its logprob) at
    each of the positions ``first[i]`` onwards, every one given the same tokens before it."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
    choices = []
    for start, context, output in zip(first, contexts, outputs):
        row = []
        for position in range(start, len(context)):
            token, logprob = min(output.prompt_logprobs[position].items(), key=lambda item: item[1].rank)
            row.append((token, logprob.logprob))
        choices.append(row)
    return choices


@pytest.mark.slow
def test_smollm2_int8_kv_keeps_greedy_output(capsys):
    """16 chat prompts, the first 64 greedy tokens of the fp32-KV answer: at
    every position, given the same tokens before it, int8 KV must pick the
    same greedy token at least 95% of the time; the mean absolute difference
    of that token's logprob is printed and bounded.

    The comparison is per position (teacher-forced) because free-running
    greedy text of a 135M model hits near-ties where any rounding sends it
    down another path: measured the same way, bf16 weights (Hugging Face's
    own recommended precision) keep only ~58% of fp32's free-running tokens.
    The free-running share is printed for the record."""
    fp32 = LLM(num_kv_blocks=1024)
    int8 = LLM(num_kv_blocks=1024, kv_cache_dtype="int8")
    tokenizer = fp32.get_tokenizer()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    answers = [o.outputs[0].token_ids for o in fp32.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                               use_tqdm=False)]
    contexts = [p + a for p, a in zip(prompts, answers)]
    starts = [len(p) for p in prompts]
    exact, quantized = _greedy_choices(fp32, contexts, starts), _greedy_choices(int8, contexts, starts)
    pairs = [(a, b) for row_a, row_b in zip(exact, quantized) for a, b in zip(row_a, row_b)]
    assert len(pairs) == 16 * 64
    agreement = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    mean_diff = sum(abs(a[1] - b[1]) for a, b in pairs) / len(pairs)
    free = [o.outputs[0].token_ids for o in int8.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                            use_tqdm=False)]
    free_share = sum(x == y for a, b in zip(answers, free) for x, y in zip(a, b)) / (16 * 64)
    with capsys.disabled():
        print(f"\nSmolLM2, int8 KV vs fp32 KV over 16 x 64 positions: same greedy token {agreement:.1%}, "
              f"mean |top-1 logprob diff| {mean_diff:.4f}; free-running {free_share:.1%} of tokens equal")
    assert agreement >= 0.95
    assert mean_diff < 0.05
    assert_pool_free(fp32)
    assert_pool_free(int8)

"""The engine with a quantized KV pool: capacity, scales through swap and the
prefix cache, bad values. SmolLM2's free-running output against fp32 KV is
tests/differential/test_kv_quant.py."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_moves import SwapIn, SwapOut
from tests.conftest import assert_pool_free
from tests.engine.test_engine_behaviour import token_ids, token_prompts


def test_int8_pool_holds_more_tokens_in_the_same_memory(tiny_llama, caplog):
    memory = 1 << 20
    auto = LLM(tiny_llama, kv_cache_memory=memory, max_num_seqs=8)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        int8 = LLM(tiny_llama, kv_cache_memory=memory, kv_cache_dtype="int8", max_num_seqs=8)
    # The tiny model: head_dim 16, so int8 + an fp32 scale is 20 bytes per vector vs 64 in fp32.
    assert auto.stats()["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert int8.stats()["bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    # The budget is all int8 blocks: full-precision tails are taken from them as sequences write.
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
    # Two sequences at a time, then preempted as they grow (int8: each also holds a 4-block tail).
    tight = LLM(tiny_llama, num_kv_blocks=18 if kv_cache_dtype == "int8" else 14, kv_cache_dtype=kv_cache_dtype,
                preemption_mode="swap", debug_invariants=True)
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
    runner.host_store.swap_out(runner.kv_caches, [SwapOut(3, 0)])
    for layer in runner.kv_caches:
        for tensor in layer.tensors():
            tensor[3] = 0
    runner.host_store.swap_in(runner.kv_caches, [SwapIn(0, 5)])
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
        probe_blocks.append(engine.kv_cache_manager.get_block_ids("probe")[0][:3])
        while engine.has_unfinished_requests():
            engine.step()
    for cached_layer, fresh_layer in zip(cached.llm_engine.runner.kv_caches, fresh.llm_engine.runner.kv_caches):
        for a, b in zip(cached_layer.tensors(), fresh_layer.tensors()):
            assert torch.equal(a[probe_blocks[0]], b[probe_blocks[1]])
    assert_pool_free(cached)
    assert_pool_free(fresh)

"""Tensor parallelism on torch.distributed (gloo, 2 processes on this machine):
the same tokens as one rank, through prefix caching, forks and preemption;
a dead worker is a clear error; no process is left behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.sharding import shard_layout, shard_state_dict
from tests.conftest import assert_pool_free
from tests.engine.test_hf_parity import prompts_for


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_no_workers_left(llm: LLM) -> None:
    executor = llm.llm_engine.executor
    llm.shutdown()
    assert executor.processes == []
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm-tp-worker")]


def test_shards_put_back_together_give_the_whole_weights(smollm_tokenizer):
    """SmolLM2's 9 heads / 3 KV heads over 2 ranks: 6 + 3 query heads with 2 + 1 KV heads."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=1)
    torch.manual_seed(0)
    whole = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(576, 576),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(192, 576),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(576, 576),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(576),
        "model.layers.0.mlp.down_proj.weight": torch.randn(576, 1536),
        "model.norm.weight": torch.randn(576),
    }
    ranks = [TensorParallelGroup(rank, 2) for rank in range(2)]
    shards = [shard_state_dict(whole, config, tp) for tp in ranks]
    layouts = [shard_layout(config, tp) for tp in ranks]
    assert [(lay.num_heads, lay.num_kv_heads, lay.intermediate_size) for lay in layouts] == [(6, 2, 768), (3, 1, 768)]
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        key = f"model.layers.0.{name}"
        assert torch.equal(torch.cat([s[key] for s in shards]), whole[key])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        key = f"model.layers.0.{name}"
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), whole[key])
    bias = "model.layers.0.self_attn.o_proj.bias"
    assert torch.equal(shards[0][bias] + shards[1][bias], whole[bias])  # added once by the all-reduce
    assert all(s["model.norm.weight"] is whole["model.norm.weight"] for s in shards)


def test_tensor_parallel_size_that_leaves_a_rank_empty_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 exceeds the model's KV heads"):
        LLM(tiny_llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(tiny_llama, tensor_parallel_size=0)


@pytest.mark.parametrize("preemption_mode,kv_cache_dtype", [
    ("recompute", "auto"), ("recompute", "int8"), pytest.param("swap", "auto", marks=pytest.mark.slow),
    pytest.param("swap", "int8", marks=pytest.mark.slow),
])
def test_two_ranks_give_the_tokens_of_one(tiny_llama, preemption_mode, kv_cache_dtype):
    """A 12-block pool (16 with int8's tails) forces preemption; prompts share a 32-token prefix (prefix
    cache hits) and n=2 forks copy blocks on write: every path's block moves
    reach the worker too (with int8, the full-precision tails' moves as well)."""
    prefix = [(17 * j) % 3000 + 200 for j in range(32)]
    prompts = [{"prompt_token_ids": prefix + [(29 * i + 7 * j) % 3000 + 300 for j in range(10 + 6 * i)]}
               for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)]
    batch_params = [params[i % 2] for i in range(5)]
    num_kv_blocks = 16 if kv_cache_dtype == "int8" else 12  # int8: and a running sequence's 4-block fp32 tail
    single = LLM(tiny_llama, num_kv_blocks=num_kv_blocks, block_size=8, preemption_mode=preemption_mode,
                 debug_invariants=True, kv_cache_dtype=kv_cache_dtype)
    expected = token_ids(single.generate(prompts, batch_params, use_tqdm=False))
    expected_again = token_ids(single.generate(prompts, batch_params, use_tqdm=False))
    tp = LLM(tiny_llama, num_kv_blocks=num_kv_blocks, block_size=8, preemption_mode=preemption_mode,
             debug_invariants=True, tensor_parallel_size=2, kv_cache_dtype=kv_cache_dtype)
    try:
        assert token_ids(tp.generate(prompts, batch_params, use_tqdm=False)) == expected
        assert token_ids(tp.generate(prompts, batch_params, use_tqdm=False)) == expected_again  # cache hits
        stats = tp.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        if preemption_mode == "swap":
            assert stats["swap_in_blocks"] > 0
        assert_pool_free(tp)
        assert_pool_free(single)
    finally:
        assert_no_workers_left(tp)


@pytest.mark.slow
def test_smollm2_on_two_ranks_matches_one():
    """SmolLM2's 3 KV heads split 2 + 1; 8 prompts of 8-300 tokens, 32 greedy tokens each."""
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    single = LLM(num_kv_blocks=256)
    prompts = [{"prompt_token_ids": p} for p in prompts_for(single.get_tokenizer())]
    expected = token_ids(single.generate(prompts, params, use_tqdm=False))
    tp = LLM(num_kv_blocks=256, tensor_parallel_size=2)
    try:
        assert "that is rank 0, with 2 of 3 KV heads" in tp.llm_engine.capacity_line()
        assert tp.stats()["bytes_per_token"] == 2 * 30 * 2 * 64 * 4
        assert token_ids(tp.generate(prompts, params, use_tqdm=False)) == expected
        assert_pool_free(tp)
    finally:
        assert_no_workers_left(tp)


def test_a_dead_worker_is_a_clear_error_not_a_hang(tiny_llama):
    tp = LLM(tiny_llama, num_kv_blocks=32, tensor_parallel_size=2, distributed_timeout_s=20)
    try:
        worker = tp.llm_engine.executor.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(pid \d+\) exited with code -9"):
            tp.generate([{"prompt_token_ids": [300, 301, 302]}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - started < 5
        with pytest.raises(RuntimeError, match="restart it"):
            tp.generate([{"prompt_token_ids": [300, 301, 302]}], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        assert_no_workers_left(tp)


def test_a_worker_started_elsewhere_joins_through_the_init_method(tiny_llama):
    """The multi-host path: `pagedllm worker` (as torchrun or a second host would
    start it) joins an engine given --distributed-init-method and receives the
    configuration from it; outputs equal one rank's."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "worker", "--distributed-init-method", init_method,
         "--rank", "1", "--world-size", "2", "--timeout", "60"],
    )
    try:
        prompts = [{"prompt_token_ids": [(13 * i + 5 * j) % 3000 + 300 for j in range(12 + 5 * i)]} for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = token_ids(LLM(tiny_llama, num_kv_blocks=32).generate(prompts, params, use_tqdm=False))
        tp = LLM(tiny_llama, num_kv_blocks=32, tensor_parallel_size=2, distributed_init_method=init_method)
        assert tp.llm_engine.executor.processes == []  # nothing spawned: the worker came on its own
        assert token_ids(tp.generate(prompts, params, use_tqdm=False)) == expected
        assert_pool_free(tp)
        tp.shutdown()
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()

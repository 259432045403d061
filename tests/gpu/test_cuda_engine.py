"""The GPU path: the same engine on CUDA. Skipped on machines without a GPU
(CI has none); run on a lent device machine with ``pytest tests/gpu``.

The Triton kernel itself is also checked on every machine: without a GPU,
tests/attention runs it through Triton's CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.selector import triton_decode
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.bench.hf_reference import load_hf_model
from pagedllm.kernels import triton_paged
from tests.conftest import assert_pool_free
from tests.engine.test_hf_parity import check_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_decode_matches_the_gather_path_on_cuda(dtype):
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads, num_heads, head_dim = 400, 16, 3, 9, 64
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    lens = torch.tensor([1, 15, 16, 17, 200, 1000], device="cuda")
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, device="cuda")[: len(lens) * width].view(len(lens), width)
    query = torch.randn(len(lens), num_heads, head_dim, device="cuda", dtype=dtype)
    metadata = AttentionMetadata(torch.zeros(0, dtype=torch.long, device="cuda"), len(lens), tables, lens, [])
    got = triton_paged.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.125)
    empty = torch.zeros(0, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    expected = TorchPagedAttention().forward(query, empty, empty, LayerKVCache(key_cache, value_cache), metadata, 0.125)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_smollm2_on_cuda_matches_hf_token_for_token():
    llm = LLM(device="cuda", num_kv_blocks=512, debug_invariants=True)
    assert llm.llm_engine.runner.attention.decode_kernel is triton_decode
    check_parity(llm, load_hf_model(None))


def test_pool_is_sized_by_gpu_memory_utilization():
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=2048)
    stats = llm.stats()
    pool_bytes = stats["num_blocks"] * stats["block_size"] * stats["bytes_per_token"]
    assert 0 < pool_bytes < 0.3 * total
    outputs = llm.generate(["Paged attention on a GPU"] * 8, SamplingParams(max_tokens=16, temperature=0.0),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    # Weights, the pool and this step's activations all fit in the fraction asked for.
    assert torch.cuda.max_memory_allocated() <= 0.3 * total
    assert_pool_free(llm)


def test_speculation_and_async_scheduling_change_nothing_on_cuda():
    from pagedllm.bench.speculative import repetitive_prompts

    plain = LLM(device="cuda", num_kv_blocks=1024)
    prompts = repetitive_prompts(plain.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=48)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    fast = LLM(device="cuda", num_kv_blocks=1024, async_scheduling=True, debug_invariants=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)] == expected
    assert fast.stats()["spec_num_accepted_tokens"] > 0
    assert_pool_free(fast)
    assert_pool_free(plain)

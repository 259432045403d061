"""The KV pool is allocated uninitialised, so no reader may depend on a slot it
never wrote: a pool filled with NaN before the first request must give the same
tokens and logprobs, bit for bit, as one filled with zeros, on every CPU path
(the C++ kernels and the PyTorch twins), for each KV storage type (int8 with
its full-precision tails), through chunked prefills, prefix-cache hits, forks
and swapped-out requests."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import load_cpu_kernels
from tests.conftest import assert_pool_free
from tests.engine.test_engine_behaviour import token_prompts
from tests.engine.test_speculative import NGRAM
from tests.poisoned_pool import poison_engine_pools

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
FORKED = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(params=["cpp", "pytorch"])
def cpu_path(request, monkeypatch):
    """The C++ kernels, or every op on its PyTorch twin (``PAGEDLLM_CPU_KERNEL=0``)."""
    if request.param == "pytorch":
        monkeypatch.setenv("PAGEDLLM_CPU_KERNEL", "0")
    load_cpu_kernels.cache_clear()
    yield request.param
    monkeypatch.delenv("PAGEDLLM_CPU_KERNEL", raising=False)
    load_cpu_kernels.cache_clear()


def _prompts() -> list[dict]:
    """Partial last blocks (lengths 5-41), and two prompts that share 32 tokens (a prefix-cache hit)."""
    prompts = [token_prompts(1, n, offset=n)[0] for n in (5, 17, 29, 41)]
    shared = token_prompts(1, 32, offset=3)[0]["prompt_token_ids"]
    return prompts + [{"prompt_token_ids": shared + [900 + i] * (3 + i)} for i in range(2)]


def _run(llm: LLM, poisoned: bool, runs: tuple[SamplingParams, ...] = (GREEDY, FORKED)) -> list:
    if poisoned:
        poison_engine_pools(llm)
    else:  # what the pool held before it was left uninitialised
        for layer in llm.llm_engine.runner.kv_caches:
            for tensor in (*layer.tensors(), layer.tail_key, layer.tail_value):
                if tensor is not None:
                    tensor.zero_()
    outputs = []
    for params in runs:
        for output in llm.generate(_prompts(), params, use_tqdm=False):
            outputs += [(list(c.token_ids), c.cumulative_logprob) for c in output.outputs]
    assert_pool_free(llm)
    return outputs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_nan_filled_pool_gives_the_same_outputs(tiny_llama, cpu_path, kv_cache_dtype):
    # 24 tokens per step: the 29- and 41-token prompts are prefilled in chunks that read the pool.
    options = dict(num_kv_blocks=64, block_size=8, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=24,
                   debug_invariants=True)
    expected = _run(LLM(tiny_llama, **options), poisoned=False)
    llm = LLM(tiny_llama, **options)
    assert (llm.llm_engine.runner.attention.decode_kernel is None) == (cpu_path == "pytorch"
                                                                       or kv_cache_dtype == "fp8_e4m3")
    assert _run(llm, poisoned=True) == expected


@pytest.mark.parametrize("options, runs", [
    # Reserved blocks stay unwritten past the context; no forks in this layout.
    ({"kv_layout": "contiguous", "max_model_len": 128}, (GREEDY,)),
    # Drafts are verified as multi-token spans over the pool.
    ({"speculative_config": NGRAM}, (GREEDY, FORKED)),
], ids=["contiguous", "ngram"])
def test_nan_filled_pool_with_other_layouts_and_speculation(tiny_llama, options, runs):
    """On the PyTorch path, the one that gathers padded ranges."""
    options = dict(num_kv_blocks=96, block_size=8, debug_invariants=True, **options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLLM_CPU_KERNEL", "0")
        load_cpu_kernels.cache_clear()
        expected = _run(LLM(tiny_llama, **options), poisoned=False, runs=runs)
        assert _run(LLM(tiny_llama, **options), poisoned=True, runs=runs) == expected
    load_cpu_kernels.cache_clear()


def test_nan_filled_pools_survive_swapping(tiny_llama, cpu_path):
    """A pool too small for the batch: requests are swapped out to the (also poisoned) host pool and back."""
    options = dict(num_kv_blocks=12, block_size=8, kv_cache_dtype="int8", preemption_mode="swap",
                   swap_space=0.01, debug_invariants=True)
    expected = _run(LLM(tiny_llama, **options), poisoned=False)
    llm = LLM(tiny_llama, **options)
    assert _run(llm, poisoned=True) == expected
    assert llm.stats()["swap_in_blocks"] > 0

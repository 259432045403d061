"""The engine with the GPU decode kernel gives the same tokens as with the CPU one.

Without a GPU the Triton kernel runs through Triton's CPU interpreter
(tests/conftest.py), so this checks the kernel against the real engine's
block tables (padded, scattered, shared prefix blocks) on every machine.
"""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.attention.selector import triton_decode
from tests.conftest import assert_pool_free


def test_triton_decode_kernel_in_the_engine_matches_the_default(tiny_llama):
    prompts = ["The block table maps", "The block table maps logical blocks", "Copy on write"]
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
    reference = LLM(tiny_llama, num_kv_blocks=64, block_size=4, debug_invariants=True)
    expected = [[c.token_ids for c in o.outputs] for o in reference.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4, debug_invariants=True)
    llm.llm_engine.runner.attention = TorchPagedAttention(triton_decode)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert_pool_free(llm)

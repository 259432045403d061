"""Tiny random Gemma 1/2/3 checkpoints: pagedllm's greedy output equals Hugging Face's token for
token (fp32; chunked prefill and prefix caching on) and its bf16 run is as close to the fp32
oracle as Hugging Face's own bf16 run."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
# test_hybrid_int8 imports the fixture from here (which gives that module its own instance of it).
from tests.conftest import assert_pool_free
from tests.distributed.test_tensor_parallel import assert_no_workers_left
from tests.engine.test_hf_parity import assert_bf16_close_to_hf, check_parity, prompts_for
from tests.model.test_gemma import GEMMA_ARCHS, assert_hf_greedy, tiny_gemma


NEW_TOKENS = 24


def check_greedy(llm: LLM, hf_model, prompts: list[list[int]]) -> list:
    """pagedllm's free-running greedy tokens are Hugging Face's (EOS masked by min_tokens in both)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_hf_greedy(hf_model, prompt, output.outputs[0], eos_masked=hf_model.config.eos_token_id)
    return outputs


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_tiny_gemma_greedy_matches_hf(arch, tiny_gemma_dir):
    folder, hf_model = tiny_gemma_dir(arch)
    # 16-token steps: prompts are prefilled in chunks, alongside other sequences' decodes.
    llm = LLM(folder, num_kv_blocks=128, max_num_batched_tokens=16, debug_invariants=True)
    text = prompts_for(llm.get_tokenizer())  # of 8, 17, 33, 64, 100, ... tokens
    prompts = [text[0][:5], text[3][:30], text[4][:90]]
    check_greedy(llm, hf_model, prompts)
    # The longest prompt's first 80 tokens (5 blocks) are cached now: prompts extending them reuse them.
    extended = [prompts[2][:80] + prompt[:length] for prompt, length in zip(prompts, [3, 20])]
    outputs = check_greedy(llm, hf_model, extended)
    assert [output.num_cached_tokens for output in outputs] == [80, 80]
    assert_pool_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_matches_hf_generate_and_prompt_logprobs(arch, tiny_gemma_dir):
    """The Llama parity check (8 prompts up to 300 tokens, HF's own generate loop, prompt logprobs)."""
    folder, hf_model = tiny_gemma_dir(arch)
    check_parity(LLM(folder, num_kv_blocks=256, max_num_batched_tokens=64, debug_invariants=True), hf_model)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_bfloat16_close_to_hf(arch, tiny_gemma_dir):
    folder, oracle = tiny_gemma_dir(arch)
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=256)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    hf_bf16 = tiny_gemma(oracle.config).to(torch.bfloat16)
    hf_bf16.load_state_dict(oracle.state_dict())
    assert_bf16_close_to_hf(prompts, outputs, oracle, hf_bf16)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_on_two_ranks_matches_hf(arch, tiny_gemma_dir):
    """The generic sharding rules suffice: one KV head per rank, the sandwich norms on
    all-reduced outputs, q/k norms per head, soft caps elementwise."""
    folder, hf_model = tiny_gemma_dir(arch)
    llm = LLM(folder, num_kv_blocks=128, max_num_batched_tokens=16, tensor_parallel_size=2, debug_invariants=True)
    try:
        text = prompts_for(llm.get_tokenizer())
        check_greedy(llm, hf_model, [text[0][:5], text[3][:30], text[4][:90]])
        assert_pool_free(llm)
    finally:
        assert_no_workers_left(llm)

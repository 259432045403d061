"""A tiny random Cohere 2 checkpoint: pagedllm's greedy output equals Hugging Face's token for token.

Six layers, two of them full attention (no rope) and four sliding (window 8, interleaved rope),
random LayerNorm weights and a ``logit_scale`` that is not 1, so each of Cohere 2's differences
from Llama (parallel attention + MLP block, bias-free LayerNorm, GPT-J rope on sliding layers
only, scaled logits) changes the tokens or their logprobs (each one undone fails a test here). With the hybrid KV cache manager on
and off: prompts several windows long, 4-token blocks, chunked prefill, and a prefix longer than
the window that comes from the prefix cache (``check_hybrid_oracle``). The pool is all-free after
each test. Two tensor-parallel ranks and a PEFT LoRA adapter (with one KV cache group, as LoRA
runs today) need nothing beyond the generic rules.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Cohere2Config

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_pool_free
from tests.distributed.test_tensor_parallel import assert_no_workers_left
from tests.engine.arch_parity import write_eager_model
from tests.engine.test_gemma_parity import check_greedy
from tests.engine.test_hf_parity import assert_bf16_close_to_hf, prompts_for
from tests.engine.test_hybrid_kv_oracle import HYBRID, _llm, check_hybrid_oracle
from tests.lora.adapters import make_peft_adapter, peft_greedy

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def tiny_cohere2(tmp_path_factory, smollm_tokenizer) -> tuple[str, torch.nn.Module]:
    """A tiny random Cohere 2 folder (with the SmolLM2 tokenizer) and its Hugging Face model."""
    config = Cohere2Config(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=len(LAYER_TYPES),
                           layer_types=LAYER_TYPES, sliding_window=WINDOW, max_position_embeddings=4096,
                           logit_scale=0.5, initializer_range=0.05, eos_token_id=smollm_tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-cohere2")
    return str(folder), write_eager_model(folder, config, smollm_tokenizer)


@HYBRID
def test_tiny_cohere2_matches_hf_past_the_window(tiny_cohere2, disable_hybrid):
    folder, hf_model = tiny_cohere2
    check_hybrid_oracle(_llm(folder, disable_hybrid), hf_model, WINDOW)


def _greedy_on_three_prompts(llm: LLM, hf_model) -> None:
    text = prompts_for(llm.get_tokenizer())
    check_greedy(llm, hf_model, [text[0][:5], text[3][:30], text[4][:90]])
    assert_pool_free(llm)


def test_tiny_cohere2_greedy_tokens_and_logprobs_match_hf(tiny_cohere2):
    """Logprobs too: ``logit_scale`` never moves the argmax, only the distribution."""
    folder, hf_model = tiny_cohere2
    _greedy_on_three_prompts(LLM(folder, num_kv_blocks=128, max_num_batched_tokens=16, debug_invariants=True),
                             hf_model)



@pytest.mark.slow
def test_tiny_cohere2_bfloat16_close_to_hf(tiny_cohere2):
    """bf16 prompt logprobs as close to the fp32 oracle as Hugging Face's own bf16 model's."""
    folder, oracle = tiny_cohere2
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=256)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    hf_bf16 = AutoModelForCausalLM.from_config(oracle.config, dtype=torch.bfloat16, attn_implementation="eager")
    hf_bf16.load_state_dict(oracle.state_dict())
    assert_bf16_close_to_hf(prompts, outputs, oracle, hf_bf16.eval())

@pytest.mark.slow
def test_tiny_cohere2_on_two_ranks_matches_hf(tiny_cohere2):
    """One KV head and half the MLP per rank; each branch of the parallel block is all-reduced
    before the add, the norms are replicated."""
    folder, hf_model = tiny_cohere2
    llm = LLM(folder, num_kv_blocks=128, max_num_batched_tokens=16, tensor_parallel_size=2, debug_invariants=True)
    try:
        _greedy_on_three_prompts(llm, hf_model)
    finally:
        assert_no_workers_left(llm)


@pytest.mark.slow
def test_tiny_cohere2_with_a_lora_adapter_matches_peft(tiny_cohere2, smollm_tokenizer, tmp_path):
    """Every projection adapted (rank 8): the fused q/k/v and gate/up parts are the Llama family's."""
    folder, _ = tiny_cohere2
    adapter = make_peft_adapter(folder, str(tmp_path / "all8"), rank=8, seed=1)
    prompts = [prompt[:40] for prompt in prompts_for(smollm_tokenizer)[3:6]]
    llm = LLM(folder, enable_lora=True, max_lora_rank=8, num_kv_blocks=128, disable_hybrid_kv_cache_manager=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=12),
                           lora_request=LoRARequest("all8", 1, adapter), use_tqdm=False)
    expected = peft_greedy(folder, adapter, prompts, 12)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert expected != peft_greedy(folder, None, prompts, 12)
    assert_pool_free(llm)

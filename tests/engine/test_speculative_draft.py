"""Speculative decoding with a draft model: greedy output is unchanged, and a
draft that is the target itself is (nearly) always right, which only holds if
the draft's own K/V follows every step, rollback and block move."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.engine.test_speculative import repetitive_prompts, token_ids


def draft_config(path: str, k: int = 3) -> dict:
    return {"model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def expected(tiny_llama):
    reference = LLM(tiny_llama, num_kv_blocks=512)
    prompts = repetitive_prompts(10, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return prompts, params, reference.generate(prompts, params)


def test_the_target_as_its_own_draft_is_accepted_and_changes_nothing(tiny_llama, expected):
    prompts, params, reference = expected
    llm = LLM(tiny_llama, num_kv_blocks=512, speculative_config=draft_config(tiny_llama), debug_invariants=True)
    assert token_ids(llm.generate(prompts, params)) == token_ids(reference)
    stats = llm.stats()
    assert stats["spec_acceptance_rate"] > 0.9, stats
    assert_pool_free(llm)


def test_another_architecture_as_draft_changes_nothing_under_preemption(tiny_llama, tiny_model_dir, expected):
    prompts, params, reference = expected
    llm = LLM(tiny_llama, num_kv_blocks=24, speculative_config=draft_config(tiny_model_dir("qwen2"), k=2),
              debug_invariants=True)
    assert token_ids(llm.generate(prompts, params)) == token_ids(reference)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert_pool_free(llm)


def test_the_draft_s_pool_is_planned_with_the_target_s(tiny_llama):
    plain = LLM(tiny_llama, kv_cache_memory=2**22)
    drafted = LLM(tiny_llama, kv_cache_memory=2**22, speculative_config=draft_config(tiny_llama))
    # The same bytes hold half the blocks: each block is paid for in both pools.
    assert drafted.stats()["num_blocks"] == plain.stats()["num_blocks"] // 2
    assert "draft model's pool" in drafted.llm_engine.capacity_line()


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, smollm_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 500 tokens"):
        LLM(tiny_llama, speculative_config=draft_config(str(tmp_path)))

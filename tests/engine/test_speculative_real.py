"""Speculation changes nothing a user sees, on the real SmolLM2 and real text:
20 chat prompts (code edits and quotes of standard-library sources, questions
about a passage), free-running to EOS or 128 tokens, with and without n-gram
speculation; the plain engine is itself held to Hugging Face by test_hf_parity."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.speculative import repetitive_prompts
from tests.conftest import assert_pool_free
from tests.engine.test_hf_parity import TEXT

QUESTIONS = (
    "Summarise this passage in two sentences",
    "Which ideas did language model serving borrow from operating systems, according to this passage",
    "Copy the first two sentences of this passage exactly",
    "List the computing eras this passage mentions",
    "Rewrite this passage for a ten-year-old",
    "What is a block table, according to this passage",
    "Quote the sentence that mentions reference counts",
    "Give this passage a title and repeat its last sentence",
)


@pytest.mark.slow
def test_greedy_output_with_ngram_speculation_is_the_plain_output_on_real_text():
    plain = LLM(num_kv_blocks=1024)
    tokenizer = plain.get_tokenizer()
    questions = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"{q}:\n\n{TEXT}"}], tokenize=False,
                                      add_generation_prompt=True)
        for q in QUESTIONS
    ]
    prompts = repetitive_prompts(tokenizer) + questions
    params = SamplingParams(temperature=0.0, max_tokens=128)
    expected = plain.generate(prompts, params, use_tqdm=False)
    speculative = LLM(num_kv_blocks=1024, debug_invariants=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = speculative.generate(prompts, params, use_tqdm=False)
    assert len(prompts) == 20
    for prompt, g, e in zip(prompts, got, expected):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, prompt[:80]
        assert g.outputs[0].text == e.outputs[0].text
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    stats = speculative.stats()
    assert stats["spec_acceptance_rate"] > 0.3, stats  # real text that repeats its context is what lookups catch
    assert_pool_free(speculative)
    assert_pool_free(plain)

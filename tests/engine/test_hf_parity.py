"""Greedy output and prefill logits match Hugging Face transformers on the same weights.

Hugging Face runs each prompt alone (no padding), pagedllm runs all of them
together in one ``generate`` call: continuous batching, paging and ragged
prefill must not change a single token.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.hf_reference import load_hf_model
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.packed_linear import PackedLinear, packing_supported
from pagedllm_dev.differential.prompts import real_text_prompts
from tests.conftest import assert_pool_free, hf_model_copy

TEXT = (
    "The history of computing is a story of layers. Early machines were programmed by rewiring "
    "panels, then by punched cards, then by assembly language written on paper and typed into "
    "terminals. Operating systems arrived to share one expensive machine among many users, and "
    "with them came virtual memory: each program saw a private, contiguous address space while "
    "the hardware scattered its pages across physical memory wherever room could be found. A "
    "page table translated every address, and a small cache of recent translations kept the cost "
    "low. When memory ran short, pages that had not been used recently were written to disk and "
    "read back on demand. Decades later the same ideas returned in a new setting. Large language "
    "models keep a cache of keys and values for every token they have seen, and serving many "
    "conversations at once means sharing a fixed amount of accelerator memory among requests "
    "whose lengths nobody knows in advance. Reserving the maximum for each request wastes most "
    "of it, so modern engines split the cache into fixed-size blocks, keep a block table per "
    "sequence, and let the attention kernel follow the table. Blocks can be shared between "
    "sequences that start with the same prompt, copied only when one of them writes, and evicted "
    "when nobody needs them. The result is that far more conversations fit in the same memory, "
    "and the throughput of the whole system rises with the batch size. Engineers who learned "
    "operating systems in school recognise every part of the design, from reference counts to "
    "least recently used eviction, and that familiarity is part of why the approach spread so "
    "quickly through the industry and became the default way to serve models at scale today."
)
PROMPT_LENGTHS = [8, 17, 33, 64, 100, 150, 220, 300]
NEW_TOKENS = 32


def prompts_for(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    if len(ids) < max(PROMPT_LENGTHS):
        raise ValueError(f"TEXT has only {len(ids)} tokens")
    # Different starting points so prompts are not prefixes of each other.
    return [ids[i % 7 : i % 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def check_parity(llm: LLM, hf_model) -> None:
    prompts = prompts_for(llm.get_tokenizer())
    # min_tokens == max_tokens masks EOS exactly as HF's min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"
            # Prefill logits: every prompt position's log-probabilities agree with HF's.
            hf_logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
            assert output.prompt_logprobs[0] is None
            max_diff = 0.0
            for position, entry in enumerate(output.prompt_logprobs[1:]):
                assert prompt[position + 1] in entry
                for token_id, logprob in entry.items():
                    max_diff = max(max_diff, abs(logprob.logprob - hf_logprobs[position, token_id].item()))
            assert max_diff < 1e-3, f"prompt of {len(prompt)} tokens: max |logprob diff| {max_diff}"


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_tiny_random_models_match_hf(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    llm = LLM(folder, num_kv_blocks=256, debug_invariants=True)
    check_parity(llm, load_hf_model(folder))


@pytest.fixture
def without_cpp_kernels(monkeypatch):
    """Every op on its PyTorch twin (the paths a GPU and a compiler-less CPU take)."""
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL", "0")
    load_cpu_kernels.cache_clear()
    yield
    monkeypatch.delenv("PAGEDLLM_CPU_KERNEL")
    load_cpu_kernels.cache_clear()


def test_tiny_model_matches_hf_on_the_pytorch_paths(tiny_model_dir, without_cpp_kernels):
    folder = tiny_model_dir("llama")
    llm = LLM(folder, num_kv_blocks=256, debug_invariants=True)
    assert llm.llm_engine.runner.attention.decode_kernel is None
    check_parity(llm, load_hf_model(folder))


def test_smollm2_gguf_matches_hf():
    llm = LLM(num_kv_blocks=512, debug_invariants=True)
    check_parity(llm, load_hf_model(None))


# bf16 is not bit-identical to Hugging Face (kernels sum in other orders and bf16
# rounding amplifies that). The documented tolerance: against the fp32 oracle,
# pagedllm's bf16 prompt log-probabilities are off by about as much as Hugging
# Face's own bf16 run: the mean over prompts of (our mean error / HF bf16's) within
# BF16_MEAN_RATIO (SmolLM2, 48 prompts: 1.02 with the packed VDPBF16PS matmuls,
# 1.02 without), no prompt past BF16_PROMPT_RATIO (measured up to 1.61 packed, 1.53
# not: one prompt's ratio swings with any change of summation order, so a tight
# per-prompt bound tests the prompt, not the engine), and no token more than
# BF16_MAX_NATS further off than HF bf16's worst token of the prompt (HF's own worst
# reaches 0.63 nats on these prompts; ours 0.60 packed, 0.62 not).
BF16_MEAN_RATIO, BF16_PROMPT_RATIO, BF16_MAX_NATS = 1.15, 2.0, 0.35


_TARGET_LOGPROBS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def target_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """The log-probability ``model`` gives each next token of ``prompt``. Memoized per model and
    prompt: both cases of a parametrized test on one model ask for the same ones."""
    memo = _TARGET_LOGPROBS.setdefault(model, {})
    if tuple(prompt) not in memo:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0].float()
        memo[tuple(prompt)] = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), prompt[1:]]
    return memo[tuple(prompt)]


def assert_bf16_close_to_hf(prompts, outputs, oracle, hf_bf16) -> None:
    """Our bf16 prompt logprobs against the fp32 oracle's: never BF16_MAX_NATS further off than
    HF bf16's worst token, and as close on average as Hugging Face's own bf16 model (see BF16_MEAN_RATIO)."""
    ratios = []
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            reference = target_logprobs(oracle, prompt)
            ours = torch.tensor([entry[prompt[i + 1]].logprob for i, entry in enumerate(output.prompt_logprobs[1:])])
            our_error = (ours - reference).abs()
            hf_error = (target_logprobs(hf_bf16, prompt) - reference).abs()
            assert our_error.max() < hf_error.max() + BF16_MAX_NATS, (
                f"prompt of {len(prompt)} tokens: {our_error.max():.3f} nats (HF bf16 {hf_error.max():.3f})"
            )
            ratios.append((our_error.mean() / hf_error.mean()).item())
            assert ratios[-1] <= BF16_PROMPT_RATIO, (
                f"prompt of {len(prompt)} tokens: mean error {our_error.mean():.4f} vs HF bf16 {hf_error.mean():.4f}"
            )
    mean_ratio = sum(ratios) / len(ratios)
    assert mean_ratio <= BF16_MEAN_RATIO, f"mean error {mean_ratio:.3f}x HF bf16's over {len(ratios)} prompts"


@pytest.fixture(scope="module")
def smollm2_fp32_and_bf16():
    """Hugging Face's SmolLM2 in fp32 (the oracle) and in bf16, once for both packing cases (whose
    Hugging Face logprobs are then computed once too: ``target_logprobs`` memoizes them)."""
    return hf_model_copy(None, torch.float32), hf_model_copy(None, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("packing_switch", ["auto", "0"])
def test_smollm2_bfloat16_close_to_hf(packing_switch, monkeypatch, smollm2_fp32_and_bf16):
    # The bf16 engine against HF's bf16 model on the same (dequantized) weights, with the
    # matmuls on weights packed for VDPBF16PS where this CPU packs them, and on nn.Linear's layout.
    # GGUF weights kept in their blocks multiply in fp32 and round each output to bf16; on
    # SmolLM2 that lands at 1.7x HF bf16's mean error (open: docs/architecture.md "GGUF weights
    # stay packed"), so this bound is for dequantize.
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", packing_switch)
    llm = LLM(dtype="bfloat16", num_kv_blocks=1024, gguf_weights="dequantize")
    packing = packing_switch == "auto" and packing_supported(torch.device("cpu"), torch.bfloat16)
    assert isinstance(llm.llm_engine.model.model.layers[0].mlp.down_proj, PackedLinear) == packing
    tokenizer = llm.get_tokenizer()
    prompts = prompts_for(tokenizer) + [tokenizer.encode(text) for text in real_text_prompts(40, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    assert_bf16_close_to_hf(prompts, outputs, *smollm2_fp32_and_bf16)

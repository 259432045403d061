"""Sliding-window models against Hugging Face, and the blocks the window releases.

Tiny random Mistral and Qwen2 checkpoints (all layers sliding, and a hybrid
with one full layer) with a window of 12 or 16 tokens; prompts and generations
run several times past the window. Greedy output must equal Hugging Face's
token for token with block sizes that do and do not divide the window, with
chunked prefill, prefix-cache hits, preemption (recompute and swap), forks
(n > 1) and beam search. With a window every layer shares, blocks that fall
out of it are released, so a long generation holds a bounded number of blocks.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.utils import cdiv
from tests.conftest import TINY_COMMON, assert_pool_free
from tests.engine.test_beam_search import hf_beam
from tests.engine.test_hf_parity import TEXT

WINDOW = 12
PROMPT_LENGTHS = [5, 23, 40, 70]
NEW_TOKENS = 40


def sliding_config(kind: str, window: int):
    """A tiny Mistral (every layer slides) or Qwen2 (sliding after ``max_window_layers`` full ones)."""
    from transformers import MistralConfig, Qwen2Config

    if kind == "mistral":
        return MistralConfig(**TINY_COMMON, sliding_window=window, tie_word_embeddings=False, rope_theta=10000.0)
    # max_window_layers: the first layers attend fully (Hugging Face's Qwen2 rule).
    full_layers = {"qwen2": 0, "qwen2-hybrid": 1}[kind]
    return Qwen2Config(**TINY_COMMON, use_sliding_window=True, sliding_window=window,
                       max_window_layers=full_layers, tie_word_embeddings=False)


def prompts(tokenizer, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    return [ids[3 * i : 3 * i + n] for i, n in enumerate(lengths)]


_HF_OUTPUTS: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Hugging Face's greedy continuation, computed once per model, prompt and length."""
    key = (id(hf_model), tuple(prompt), new_tokens)
    if key not in _HF_OUTPUTS:
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        _HF_OUTPUTS[key] = out[0, len(prompt):].tolist()
    return _HF_OUTPUTS[key]


def greedy(new_tokens: int = NEW_TOKENS, n: int = 1) -> SamplingParams:
    # min_tokens == max_tokens masks EOS exactly as HF's min_new_tokens does.
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, n=n)


def check_greedy(llm: LLM, hf_model, batch: list[list[int]], n: int = 1) -> None:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(n=n), use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        expected = hf_greedy(hf_model, prompt)
        assert [c.token_ids for c in output.outputs] == [expected] * n, f"prompt of {len(prompt)} tokens"


SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind, block_size, chunked", [
    ("mistral", 8, True),  # 8 does not divide the window
    pytest.param("mistral", 8, False, marks=SLOW),
    pytest.param("mistral", 4, True, marks=SLOW),  # 4 divides it
    pytest.param("mistral", 4, False, marks=SLOW),
    pytest.param("qwen2", 16, True, marks=SLOW),  # larger than the window
    pytest.param("qwen2", 4, False, marks=SLOW),
    pytest.param("qwen2-hybrid", 8, True, marks=SLOW),  # a full layer: nothing is released
    pytest.param("qwen2-hybrid", 4, False, marks=SLOW),
])
def test_sliding_models_match_hf(sliding_model, kind, block_size, chunked):
    folder, hf_model = sliding_model(kind)
    options = dict(max_num_batched_tokens=16, long_prefill_token_threshold=7) if chunked else {}
    llm = LLM(folder, num_kv_blocks=256, block_size=block_size, debug_invariants=True, **options)
    batch = prompts(llm.get_tokenizer())
    check_greedy(llm, hf_model, batch)
    # Again: the prompts now hit the prefix cache (only blocks still cached are reused).
    check_greedy(llm, hf_model, batch)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert_pool_free(llm)


def test_released_blocks_bound_a_long_generation(sliding_model):
    window, block_size, new_tokens = 16, 4, 60
    folder, hf_model = sliding_model("mistral", window)
    llm = LLM(folder, num_kv_blocks=64, block_size=block_size, debug_invariants=True)
    prompt = prompts(llm.get_tokenizer(), [6])[0]
    output = llm.generate([{"prompt_token_ids": prompt}], greedy(new_tokens), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, new_tokens)
    peak = llm.stats()["peak_blocks_in_use"]
    assert peak <= cdiv(window, block_size) + 1 < cdiv(len(prompt) + new_tokens, block_size)
    assert_pool_free(llm)


def test_a_windowed_model_takes_a_request_longer_than_its_pool(sliding_model):
    """Admission counts what a request holds at once: with steps of at most 8 tokens a
    window of 16 keeps at most cdiv(15 + 8, 4) + 1 = 7 blocks of 4, so a 100-token
    request (25 blocks) runs in an 8-block pool and still equals Hugging Face."""
    folder, hf_model = sliding_model("mistral", 16)
    llm = LLM(folder, num_kv_blocks=8, block_size=4, max_num_batched_tokens=8, debug_invariants=True)
    prompt = prompts(llm.get_tokenizer(), [40])[0]
    output = llm.generate([{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 60)
    assert llm.stats()["peak_blocks_in_use"] <= 7 < cdiv(len(prompt) + 60, 4)
    with pytest.raises(ValueError, match="needs 9 KV blocks"):  # a step of 16 tokens: 9 blocks at once
        LLM(folder, num_kv_blocks=8, block_size=4, max_num_batched_tokens=16).generate(
            [{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)
    assert_pool_free(llm)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "disable-hybrid"])
def test_a_hybrid_models_sliding_group_keeps_only_its_window(sliding_model, hybrid):
    """The full-attention group keeps every block and the sliding group only its
    window; ``disable_hybrid_kv_cache_manager`` makes one group that keeps every block."""
    folder, _ = sliding_model("qwen2-hybrid")
    llm = LLM(folder, num_kv_blocks=64, block_size=4, disable_hybrid_kv_cache_manager=not hybrid)
    prompt = prompts(llm.get_tokenizer(), [6])[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)
    window_blocks = cdiv(WINDOW, 4) + 1 if hybrid else 0
    assert llm.stats()["peak_blocks_in_use"] == cdiv(len(prompt) + 60 - 1, 4) + window_blocks
    # The pool view says which group each cached block serves, and what the groups are.
    snapshot = llm.kv_pool_snapshot()
    kinds = [(group["kind"], group["window"]) for group in snapshot["kv_groups"]]
    assert kinds == ([("full", None), ("sliding_window", WINDOW)] if hybrid else [("full", None)])
    assert {block["group"] for block in snapshot["blocks"] if block["state"] == "cached"} == set(range(len(kinds)))
    assert_pool_free(llm)


@SLOW
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_released_blocks_matches_hf(sliding_model, mode):
    folder, hf_model = sliding_model("mistral")
    # Six requests of up to 110 tokens in a 28-block pool (the most one request may need).
    llm = LLM(folder, num_kv_blocks=28, block_size=4, preemption_mode=mode, swap_space=0.01,
              max_num_batched_tokens=32, debug_invariants=True)
    batch = prompts(llm.get_tokenizer(), [70, 64, 50, 41, 30, 66])
    check_greedy(llm, hf_model, batch)
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_free(llm)


@SLOW
def test_forks_and_beams_share_released_tables(sliding_model):
    folder, hf_model = sliding_model("mistral")
    llm = LLM(folder, num_kv_blocks=128, block_size=4, debug_invariants=True)
    batch = prompts(llm.get_tokenizer(), [23, 40])
    check_greedy(llm, hf_model, batch, n=3)
    params = BeamSearchParams(beam_width=3, max_tokens=30)
    for prompt, output in zip(batch, llm.beam_search([{"prompt_token_ids": p} for p in batch], params)):
        assert output.sequences[0].tokens[len(prompt):] == hf_beam(hf_model, prompt, params)
    assert_pool_free(llm)

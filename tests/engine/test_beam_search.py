"""Beam search equals Hugging Face's and shares blocks between hypotheses."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from pagedllm.bench.hf_reference import load_hf_model
from tests.conftest import assert_pool_free

PROMPTS = [
    "The old lighthouse keeper climbed the stairs",
    "In a distant galaxy, scientists discovered",
    "def add(a, b):",
]


def hf_beam(hf_model, prompt_ids: list[int], params: BeamSearchParams) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=params.beam_width,
        do_sample=False,
        max_new_tokens=params.max_tokens,
        early_stopping=params.early_stopping,
        length_penalty=params.length_penalty,
        num_return_sequences=1,
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    # HF pads a hypothesis that ended early; ours stops at its EOS.
    eos = hf_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


def check_against_hf(llm: LLM, hf_model, params: BeamSearchParams) -> None:
    tokenizer = llm.get_tokenizer()
    outputs = llm.beam_search(PROMPTS, params)
    assert_pool_free(llm)
    with torch.inference_mode():
        for prompt, output in zip(PROMPTS, outputs):
            ids = tokenizer.encode(prompt)
            assert len(output.sequences) == params.beam_width
            scores = [s.score for s in output.sequences]
            assert scores == sorted(scores, reverse=True)
            best = output.sequences[0]
            assert best.tokens[: len(ids)] == ids
            assert best.tokens[len(ids) :] == hf_beam(hf_model, ids, params), prompt


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=4, max_tokens=12),
        BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5, early_stopping=True),
    ],
)
def test_tiny_model_beam_search_matches_hf(tiny_model_dir, params):
    folder = tiny_model_dir("llama")
    check_against_hf(LLM(folder, num_kv_blocks=128, debug_invariants=True), load_hf_model(folder), params)


@pytest.mark.slow
def test_smollm2_beam_search_matches_hf():
    params = BeamSearchParams(beam_width=4, max_tokens=16)
    check_against_hf(LLM(num_kv_blocks=256, debug_invariants=True), load_hf_model(None), params)


def test_beams_share_prefix_blocks(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompt = {"prompt_token_ids": [(17 * j) % 3000 + 300 for j in range(400)]}
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    shared = LLM(folder, num_kv_blocks=200, debug_invariants=True)
    out = shared.beam_search([prompt], params)[0]
    copied = LLM(folder, num_kv_blocks=200, enable_block_sharing=False)
    assert [s.tokens for s in copied.beam_search([prompt], params)[0].sequences] == [s.tokens for s in out.sequences]
    # 400-token prompt = 25 blocks, stored once; each beam adds at most 2 blocks of its own.
    assert shared.stats()["peak_blocks_in_use"] <= 25 + 4 * 3
    assert copied.stats()["peak_blocks_in_use"] >= 4 * 25
    assert all(len(s.tokens) == 420 for s in out.sequences)
    assert_pool_free(shared)
    assert_pool_free(copied)


def test_bad_beam_params_are_value_errors():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="min_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=4, min_tokens=5)

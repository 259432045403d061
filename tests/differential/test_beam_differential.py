"""Beam search against Hugging Face's over the differential grid: every width
1-8, EOS active / forbidden (HF's min_new_tokens) / ordinary (vLLM's
ignore_eos), length penalties and early_stopping modes. Each rank's sequence
must be HF's, and its score HF's ``sequences_scores`` within float noise."""

from __future__ import annotations

import pytest

from pagedllm_dev.differential.beam import beam_grid, describe
from pagedllm_dev.differential.cases import CaseOptions, build_cases
from pagedllm_dev.differential.compare import describe_divergence
from pagedllm_dev.differential.harness import run_case
from pagedllm_dev.differential.prompts import real_text_prompts
from tests.conftest import assert_pool_free

# float32 logits of two implementations, summed over the tokens; relative
# because a negative length penalty multiplies a score by length ** 0.5.
SCORE_TOLERANCE = dict(rel=1e-5, abs=1e-5)


def check_beam_grid(options: CaseOptions, prompts: list[str], names: set[str] | None = None) -> None:
    """Every configuration of the grid (or those ``names``) on ``prompts``."""
    cases = build_cases(["beam"], options)
    assert [case.name for case in cases] == [describe(p) for p in beam_grid(options.max_tokens)]
    for case in [case for case in cases if names is None or case.name in names]:
        report = run_case(case, prompts)
        decode = case.engines[0].get_tokenizer().decode
        assert not report.divergences(), "\n".join(
            f"{case.name}: {describe_divergence(c, decode)}" for c in report.divergences())
        for comparison in report.comparisons:
            for expected, got in comparison.ranked_pairs():
                assert got.score == pytest.approx(expected.score, **SCORE_TOLERANCE), (case.name, comparison.prompt)
    assert_pool_free(cases[0].engines[0])


def test_grid_covers_widths_eos_rules_penalties_and_stopping_modes():
    grid = beam_grid(16)
    assert {p.beam_width for p in grid} == set(range(1, 9))
    assert any(p.ignore_eos for p in grid) and any(p.min_tokens for p in grid)
    assert any(not p.ignore_eos and not p.min_tokens for p in grid)
    assert {p.early_stopping for p in grid} == {True, False, "never"}
    assert {0.0, 1.0, 2.0, -0.5} <= {p.length_penalty for p in grid}


def test_beam_grid_slice_matches_hf_on_tiny_model(tiny_model_dir):
    """The fast slice: four configurations (widths 1, 2, 4, 8; each EOS rule;
    every early_stopping mode) on three prompts."""
    max_tokens = 8
    grid = beam_grid(max_tokens)
    names = {describe(grid[i]) for i in (0, 3, 5, 11)}
    check_beam_grid(CaseOptions(tiny_model_dir("llama"), max_tokens, num_kv_blocks=256),
                    real_text_prompts(3, seed=1, max_words=40), names)


@pytest.mark.slow
def test_beam_grid_matches_hf_on_smollm2():
    """The whole grid on SmolLM2, where answers end with EOS."""
    check_beam_grid(CaseOptions(None, max_tokens=8, num_kv_blocks=512), real_text_prompts(3, seed=2, max_words=60))


def test_runner_up_divergence_is_reported_with_its_rank():
    from pagedllm_dev.differential.compare import Comparison, DifferentialReport, Generation

    oracle = Generation((1, 2, 3), -0.5, runners_up=(Generation((1, 2, 4), -0.6),))
    feature = Generation((1, 2, 3), -0.5001, runners_up=(Generation((1, 5, 4), -0.7),))
    comparison = Comparison("a prompt", oracle, feature)
    assert comparison.identical and not comparison.all_ranks_identical
    assert comparison.score_error() == pytest.approx(1e-4)  # only identical ranks have a score error
    report = DifferentialReport("case", [comparison])
    assert report.divergences() == [comparison]
    assert "rank 1, token 1" in describe_divergence(comparison, lambda ids: " ".join(map(str, ids)))

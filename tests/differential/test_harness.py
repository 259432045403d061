"""The differential harness itself: its prompts, its comparison arithmetic, its
command line, and cases run end to end on a tiny model (the real-model runs
are in the case-specific files and in `python -m pagedllm_dev.differential`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm_dev.differential import cli
from pagedllm_dev.differential.cases import CaseOptions, build_cases
from pagedllm_dev.differential.compare import Comparison, DifferentialReport, Generation, format_reports
from pagedllm_dev.differential.harness import DifferentialCase, run_case
from pagedllm_dev.differential.prompts import prose_paragraphs, real_text_prompts
from tests.conftest import assert_pool_free


def test_prompts_are_real_varied_distinct_and_reproducible():
    prompts = real_text_prompts(60, seed=3, min_words=4, max_words=160)
    assert prompts == real_text_prompts(60, seed=3, min_words=4, max_words=160)
    assert prompts != real_text_prompts(60, seed=4, min_words=4, max_words=160)
    assert len(set(prompts)) == 60
    lengths = sorted(len(p.split()) for p in prompts)
    assert lengths[0] >= 4 and lengths[-1] <= 160 and lengths[5] < 15 < 80 < lengths[-5]
    assert all(">>>" not in p for p in prompts)
    assert len(prose_paragraphs()) > 500


def test_bad_prompt_requests_are_value_errors():
    with pytest.raises(ValueError, match="count must be at most"):
        real_text_prompts(10**6)
    with pytest.raises(ValueError, match="min_words <= max_words"):
        real_text_prompts(3, min_words=10, max_words=5)
    with pytest.raises(ValueError, match="unknown differential case"):
        build_cases(["no-such-case"], CaseOptions())


token_lists = st.lists(st.integers(0, 5), max_size=12)


@given(token_lists, token_lists)
def test_first_divergence_and_agreement(expected, got):
    comparison = Comparison("p", Generation(tuple(expected)), Generation(tuple(got)))
    position = comparison.first_divergence
    if expected == got:
        assert position is None and comparison.agreeing_positions == len(expected)
    else:
        assert expected[:position] == got[:position]
        assert position == min(len(expected), len(got)) or expected[position] != got[position]
    assert comparison.agreeing_positions <= comparison.positions == max(len(expected), len(got))


def test_report_counts_positions_and_errors_on_the_common_prefix_only():
    same = Comparison("a", Generation((1, 2, 3), -1.0, (-0.1, -0.2, -0.7)),
                      Generation((1, 2, 3), -1.5, (-0.1, -0.3, -0.7)))
    parted = Comparison("b", Generation((1, 2, 3, 4), -2.0, (-0.5, -0.5, -0.5, -0.5)),
                        Generation((1, 9, 3, 4), -9.0, (-0.6, -5.0, -5.0, -5.0)))
    report = DifferentialReport("case", [same, parted])
    assert report.identical_fraction == 0.5
    assert report.position_agreement == 6 / 7
    assert report.max_score_error == pytest.approx(0.5)  # the parted pair's scores are not comparable
    mean, largest = report.logprob_error()
    assert largest == pytest.approx(0.1) and mean == pytest.approx(0.2 / 4)
    assert [c.prompt for c in report.divergences()] == ["b"]
    assert "| case | 2 | 50.0% | 50.0% | 85.7% |" in format_reports([report])  # no runners-up: ranks = best


def test_a_side_returning_too_few_generations_is_an_error():
    case = DifferentialCase("short", oracle=lambda prompts: [Generation((1,))] * len(prompts),
                            feature=lambda prompts: [])
    with pytest.raises(RuntimeError, match="2 prompts gave 2 oracle and 0 feature"):
        run_case(case, ["x", "y"])


def test_greedy_speculation_async_chunking_and_preemption_cases_agree_on_a_tiny_model(tiny_llama):
    cases = build_cases(["greedy-hf", "speculative", "async", "chunked-prefill", "preemption"], CaseOptions(model=tiny_llama, max_tokens=16, num_kv_blocks=128))
    prompts = real_text_prompts(16, seed=1, max_words=100)
    for case in cases:
        report = run_case(case, prompts)
        assert report.identical_fraction == 1.0, [c.first_divergence for c in report.comparisons]
        assert report.logprob_error()[1] < 1e-3
        for llm in case.engines:
            assert_pool_free(llm)
    assert cases[-1].engines[1].stats()["num_preemptions"] > 0  # the small pool did preempt


def test_engine_options_reach_every_engine_of_a_case_and_its_own_option_wins(tiny_llama):
    options = CaseOptions(model=tiny_llama, max_tokens=4, num_kv_blocks=64,
                          engine={"enable_prefix_caching": False, "num_kv_blocks": 999})
    (case,) = build_cases(["preemption"], options)
    plain, changed = case.engines
    for llm in case.engines:
        assert llm.llm_engine.config.cache.enable_prefix_caching is False
        assert_pool_free(llm)
    # num_kv_blocks is the options' own field (not the engine dict's), and the case's 40 wins on its side.
    assert (plain.stats()["num_blocks"], changed.stats()["num_blocks"]) == (64, 40)


def test_the_command_line_runs_the_cases_and_records_how_it_was_run(tiny_llama, tmp_path, capsys):
    record = tmp_path / "BENCH.md"
    cli.main(["--model", tiny_llama, "--cases", "async", "--num-prompts", "2", "--max-tokens", "4",
              "--num-kv-blocks", "64", "--record", str(record)])
    assert "| async scheduling vs synchronous steps | 2 | 100.0% |" in capsys.readouterr().out
    assert f"`python -m pagedllm_dev.differential --model {tiny_llama} --cases async" in record.read_text()


def test_the_command_line_refuses_an_unknown_case_before_building_an_engine(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--cases", "greedy-hf,no-such-case"])
    assert exc.value.code == 2 and "unknown differential case(s) ['no-such-case']" in capsys.readouterr().err

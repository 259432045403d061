"""The adaptive draft policy: a fitted cost per verification row against each
sequence's recent acceptance."""

from __future__ import annotations

import pytest

from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.worker.spec_decode.draft_policy import DraftPolicy, StepCostModel


def test_the_cost_model_recovers_intercept_and_per_row_cost():
    model = StepCostModel()
    for step in range(40):
        rows = 1 + step % 5
        model.record(rows, 0.020 + 0.004 * rows)
    intercept, per_row = model.fit()
    assert intercept == pytest.approx(0.020) and per_row == pytest.approx(0.004)


def test_the_cost_model_needs_a_spread_of_row_counts():
    model = StepCostModel()
    for _ in range(40):
        model.record(1, 0.02)
    assert model.fit() is None


def teach(policy: DraftPolicy, per_row: float, steps: int = 20) -> None:
    """Single-sequence decode steps of 1 and 5 rows costing 10 ms + per_row each."""
    for step in range(steps):
        rows = 1 if step % 2 else 5
        policy.record_step(rows, 0.010 + per_row * rows)


def test_rejected_drafts_stop_where_rows_are_dear_and_probe_again_later():
    policy = DraftPolicy(num_speculative_tokens=4)
    teach(policy, per_row=0.0025)  # a 5-row step costs 1.8x a 1-row one
    assert policy.should_draft("s", 4, step_rows=1, step_tokens=1)  # a new sequence is given the benefit
    for _ in range(6):
        policy.record_verification("s", 0)  # every draft rejected
    probes = []
    for step in range(2000):
        if policy.should_draft("s", 4, step_rows=1, step_tokens=1):
            probes.append(step)
            policy.record_verification("s", 0)  # and rejected again
    assert probes and probes[0] > 10  # not on the next step
    # Nothing ever accepted: once settled, the probes' extra rows cost under 3% of the steps' time.
    settled = [step for step in probes if step >= 1000]
    assert settled and len(settled) * 0.8 / 1000 <= 0.03


def test_accepted_drafts_keep_drafting_where_rows_are_dear():
    policy = DraftPolicy(num_speculative_tokens=4)
    teach(policy, per_row=0.0025)
    for accepted in (4, 3, 4, 2, 4):
        policy.record_verification("copying", accepted)
        assert policy.should_draft("copying", 4, step_rows=1, step_tokens=1)


def test_cheap_rows_draft_even_at_low_acceptance():
    policy = DraftPolicy(num_speculative_tokens=4)
    teach(policy, per_row=0.0001)  # a 5-row step costs 1.04x a 1-row one
    for _ in range(6):
        policy.record_verification("s", 0)
        policy.record_verification("s", 1)
    assert policy.should_draft("s", 4, step_rows=1, step_tokens=1)


def test_in_a_large_batch_a_draft_must_beat_the_batch_s_rate():
    policy = DraftPolicy(num_speculative_tokens=4)
    for step in range(40):  # 32-sequence decode steps, some rows drafted
        rows = 32 + 4 * (step % 3)
        policy.record_step(rows, 0.040 + 0.002 * rows)
    # 32 tokens per 104 ms; 4 rows cost 8 ms, so a draft needs ~2.5 accepted tokens.
    for _ in range(8):
        policy.record_verification("s", 1)
    assert not policy.should_draft("s", 4, step_rows=32, step_tokens=32)
    assert policy.should_draft("new", 4, step_rows=32, step_tokens=32)


def test_forget_starts_a_sequence_over():
    policy = DraftPolicy(num_speculative_tokens=4)
    teach(policy, per_row=0.0025)
    for _ in range(6):
        policy.record_verification("s", 0)
    assert not policy.should_draft("s", 4, step_rows=1, step_tokens=1)
    policy.forget("s")
    assert policy.should_draft("s", 4, step_rows=1, step_tokens=1)


def test_the_policy_is_named_in_the_config_and_checked():
    assert SpeculativeConfig.from_option({"method": "ngram"}).draft_policy == "adaptive"
    assert SpeculativeConfig.from_option({"method": "ngram", "draft_policy": "always"}).draft_policy == "always"
    with pytest.raises(ValueError, match="draft_policy must be one of adaptive, always"):
        SpeculativeConfig.from_option({"method": "ngram", "draft_policy": "never"})

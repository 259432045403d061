"""When an n-gram proposal is worth its verification rows.

Torch-free. A draft of ``j`` tokens adds ``j`` rows to the target's next
step. Where rows are nearly free (a GPU, or fp32 weights on a CPU whose decode
step is bound by streaming the weights) drafting always pays; where they are
not (packed 4-bit weights on one CPU core, where a 5-row step costs about
twice a 1-row one) a draft that is rejected slows the request down, and on
text that does not repeat its context most prompt-lookup drafts are.

So the policy weighs both sides, per sequence and step:

- the cost: decode step seconds as ``a + b * rows``, fitted online over the
  runner's recent decode steps (``StepCostModel``), so ``b * j`` is what the
  draft adds;
- the gain: each sequence's recent mean accepted drafts per verified step (an
  exponential average, optimistic for a new sequence).

A draft is proposed when its expected tokens per extra second are at least
the step's own tokens per second. A sequence that stopped drafting drifts
back towards the optimistic prior on each step where a draft was available,
so it probes again now and then and picks copying up again when its text
starts to repeat; each probe rejected in a row halves that drift, so text
that never repeats pays for ever fewer of them. Greedy output never depends on any of this (speculation
changes only how many tokens a step yields).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCostModel:
    """Decode step seconds as ``intercept + per_row * rows``: exponentially
    weighted least squares over the recent steps (``decay`` per step)."""

    decay: float = 0.97
    # Weighted sums of 1, rows, rows^2, seconds, rows * seconds.
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def record(self, rows: int, seconds: float) -> None:
        sums = self._sums
        for i, value in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            sums[i] = sums[i] * self.decay + value

    def fit(self) -> tuple[float, float] | None:
        """(intercept, per_row) seconds, or None while the recent steps' row
        counts are too alike to tell the two apart."""
        n, r, rr, t, rt = self._sums
        if n < 4:
            return None
        variance = rr / n - (r / n) ** 2
        if variance < 0.25:  # e.g. every step one row: no slope to see yet
            return None
        per_row = (rt / n - (r / n) * (t / n)) / variance
        return t / n - per_row * r / n, max(0.0, per_row)


class DraftPolicy:
    """Per-sequence decisions: draft now or not.

    Safety rule: ``forget`` a sequence whenever its proposer state is
    forgotten (the runner dropped it).
    """

    # Weight of the latest verification in a sequence's mean accepted drafts.
    ACCEPTED_WEIGHT = 0.3
    # Share of the gap to the prior closed per step a draft was available but
    # withheld, halved for each wholly rejected draft in a row (up to MAX_MISSES).
    RECOVERY = 0.05
    MAX_MISSES = 6

    def __init__(self, num_speculative_tokens: int) -> None:
        self.prior = float(num_speculative_tokens)
        self.cost = StepCostModel()
        self._sequences: dict[str, _SequenceDrafts] = {}

    def forget(self, sequence_id: str) -> None:
        self._sequences.pop(sequence_id, None)

    def _state(self, sequence_id: str) -> _SequenceDrafts:
        state = self._sequences.get(sequence_id)
        if state is None:
            state = self._sequences[sequence_id] = _SequenceDrafts(self.prior)
        return state

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt tokens) of ``rows`` rows took ``seconds``."""
        self.cost.record(rows, seconds)

    def record_verification(self, sequence_id: str, num_accepted: int) -> None:
        state = self._state(sequence_id)
        state.mean_accepted += self.ACCEPTED_WEIGHT * (num_accepted - state.mean_accepted)
        state.misses = 0 if num_accepted else min(self.MAX_MISSES, state.misses + 1)

    def should_draft(self, sequence_id: str, num_drafts: int, step_rows: int, step_tokens: int) -> bool:
        """Whether to propose ``num_drafts`` tokens for the next step, given
        this step's rows and the tokens it yields with no drafts."""
        fit = self.cost.fit()
        if fit is None:
            return True
        intercept, per_row = fit
        state = self._state(sequence_id)
        plain_tokens_per_s = step_tokens / max(1e-9, intercept + per_row * step_rows)
        if state.mean_accepted >= plain_tokens_per_s * per_row * num_drafts:
            return True
        recovery = self.RECOVERY * 0.5 ** max(0, state.misses - 1)
        state.mean_accepted += recovery * (self.prior - state.mean_accepted)
        return False


@dataclass
class _SequenceDrafts:
    mean_accepted: float  # recent mean accepted drafts per verified step
    misses: int = 0  # wholly rejected drafts in a row

"""What a feature's output and its oracle's agree on, per sequence and per run.

Free-running outputs are compared as a user sees them: once a token differs
the texts part, so a run reports both whole-sequence identity and position-wise
agreement. Logprob and score errors are only meaningful while both saw the
same context, so they are taken over the common prefix (before the first
divergence) and over sequences that are identical, respectively.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.bench.tables import markdown_table


@dataclass(frozen=True)
class Generation:
    """One generated sequence: its ids, and when the engine reports them, its
    score (a beam's ranking score, or a sample's cumulative logprob) and the
    logprob of each generated token. A search that returns several ranked
    sequences (beam search) gives the best with the others as ``runners_up``,
    best first."""

    token_ids: tuple[int, ...]
    score: float | None = None
    logprobs: tuple[float, ...] | None = None
    runners_up: tuple[Generation, ...] = ()


@dataclass(frozen=True)
class Comparison:
    """One prompt: the oracle's generation and the feature's."""

    prompt: str
    expected: Generation
    got: Generation

    @property
    def first_divergence(self) -> int | None:
        """The first position where the sequences differ (a length difference
        counts at the shorter length), or None when identical."""
        expected, got = self.expected.token_ids, self.got.token_ids
        for position, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                return position
        return None if len(expected) == len(got) else min(len(expected), len(got))

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def ranked_pairs(self) -> list[tuple[Generation, Generation]]:
        """(oracle, feature) at each rank: the best, then the runners-up."""
        return list(zip((self.expected, *self.expected.runners_up), (self.got, *self.got.runners_up)))

    @property
    def all_ranks_identical(self) -> bool:
        """The best sequence and every runner-up are the same, rank by rank."""
        return len(self.expected.runners_up) == len(self.got.runners_up) and all(
            a.token_ids == b.token_ids for a, b in self.ranked_pairs())

    @property
    def agreeing_positions(self) -> int:
        """Positions holding the same token in both (over the longer length)."""
        return sum(a == b for a, b in zip(self.expected.token_ids, self.got.token_ids))

    @property
    def positions(self) -> int:
        return max(len(self.expected.token_ids), len(self.got.token_ids))

    def logprob_errors(self) -> list[float]:
        """|logprob difference| at each position of the common prefix (empty
        when either side has no logprobs)."""
        if self.expected.logprobs is None or self.got.logprobs is None:
            return []
        common = self.positions if self.identical else self.first_divergence
        return [abs(a - b) for a, b in list(zip(self.expected.logprobs, self.got.logprobs))[:common]]

    def score_error(self) -> float | None:
        """The largest |score difference| of identical sequences at one rank
        that both carry a score (None when there are none)."""
        errors = [abs(a.score - b.score) for a, b in self.ranked_pairs()
                  if a.token_ids == b.token_ids and a.score is not None and b.score is not None]
        return max(errors, default=None)


@dataclass
class DifferentialReport:
    """A whole run of one case."""

    case: str
    comparisons: list[Comparison]

    @property
    def identical_fraction(self) -> float:
        return sum(c.identical for c in self.comparisons) / len(self.comparisons)

    @property
    def all_ranks_identical_fraction(self) -> float:
        return sum(c.all_ranks_identical for c in self.comparisons) / len(self.comparisons)

    @property
    def position_agreement(self) -> float:
        """Agreeing positions over all positions: the free-running agreement."""
        total = sum(c.positions for c in self.comparisons)
        return sum(c.agreeing_positions for c in self.comparisons) / total if total else 1.0

    @property
    def max_score_error(self) -> float:
        errors = [e for c in self.comparisons if (e := c.score_error()) is not None]
        return max(errors, default=0.0)

    def logprob_error(self) -> tuple[float, float]:
        """(mean, max) per-token |logprob difference| over the common prefixes."""
        errors = [e for c in self.comparisons for e in c.logprob_errors()]
        return (sum(errors) / len(errors), max(errors)) if errors else (0.0, 0.0)

    def divergences(self) -> list[Comparison]:
        """Prompts where any rank differs (only the best, for one-sequence cases)."""
        return [c for c in self.comparisons if not c.all_ranks_identical]

    def summary_row(self) -> list[str]:
        mean_lp, max_lp = self.logprob_error()
        return [self.case, str(len(self.comparisons)), f"{self.identical_fraction:.1%}",
                f"{self.all_ranks_identical_fraction:.1%}", f"{self.position_agreement:.1%}",
                f"{self.max_score_error:.2e}", f"{mean_lp:.2e}", f"{max_lp:.2e}"]


SUMMARY_HEADER = ["case", "prompts", "identical", "all ranks identical", "positions agreeing", "max score error",
                  "mean logprob error", "max logprob error"]


def format_reports(reports: Sequence[DifferentialReport]) -> str:
    """A markdown table, one row a case."""
    return markdown_table(SUMMARY_HEADER, [r.summary_row() for r in reports])


def describe_divergence(comparison: Comparison, decode) -> str:
    """A line for a failing test or a bench log: at the first rank whose
    sequences differ, where and how the two part. ``decode`` turns token ids
    into text."""
    ranks = [Comparison(comparison.prompt, a, b) for a, b in comparison.ranked_pairs()]
    rank = next((i for i, c in enumerate(ranks) if not c.identical), 0)
    position = ranks[rank].first_divergence or 0
    expected, got = ranks[rank].expected, ranks[rank].got
    where = f"rank {rank}, " if rank else ""
    return (f"prompt {comparison.prompt[:60]!r}: first divergence at {where}token {position}; "
            f"oracle {decode(list(expected.token_ids[position:position + 8]))!r} (score {expected.score}), "
            f"feature {decode(list(got.token_ids[position:position + 8]))!r} (score {got.score})")

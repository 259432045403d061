"""What the client saw of each request, and the statistics and table of a run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.bench.tables import markdown_table

# Enough failure messages to tell what went wrong without flooding the report.
MAX_KEPT_ERRORS = 5


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``p`` percent of ``values`` at or
    below it (so it is always one of the values, and p50 <= p90 <= p99). NaN when there are no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p * len(ordered) / 100))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LatencyStats:
    """Mean and nearest-rank percentiles of one latency, in seconds (NaN when nothing was measured)."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        mean = sum(values) / len(values) if values else math.nan
        return cls(mean, percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass
class RequestMetrics:
    """What the client saw of one request. ``error`` is set when it failed, and then only
    ``prompt_tokens`` is meaningful. ``ttft_s`` is None when the stream carried no text at all."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``; None for
        failed requests and for those with fewer than two output tokens (no gap to measure)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class ServeResult:
    """One benchmark run at one request rate. Token totals, rates and latency statistics cover
    the completed requests only; failed ones are counted in ``num_failed`` and the first
    ``MAX_KEPT_ERRORS`` of their messages are kept in ``errors``."""

    model: str
    request_rate: float
    num_requests: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second of wall time
    output_tokens_per_s: float
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    errors: list[str]
    requests: list[RequestMetrics] = field(repr=False)

    @property
    def num_completed(self) -> int:
        return self.num_requests - self.num_failed


def summarize(model: str, request_rate: float, metrics: list[RequestMetrics], duration_s: float) -> ServeResult:
    """Fold per-request metrics into a ``ServeResult`` (statistics over completed requests only)."""
    done = [m for m in metrics if m.ok]
    failed = [m for m in metrics if not m.ok]
    return ServeResult(
        model=model,
        request_rate=request_rate,
        num_requests=len(metrics),
        num_failed=len(failed),
        duration_s=duration_s,
        total_prompt_tokens=sum(m.prompt_tokens for m in done),
        total_output_tokens=sum(m.output_tokens for m in done),
        request_throughput=len(done) / duration_s,
        output_tokens_per_s=sum(m.output_tokens for m in done) / duration_s,
        ttft=LatencyStats.of([m.ttft_s for m in done if m.ttft_s is not None]),
        tpot=LatencyStats.of([m.tpot_s for m in done if m.tpot_s is not None]),
        e2e=LatencyStats.of([m.e2e_s for m in done if m.e2e_s is not None]),
        errors=[str(m.error) for m in failed[:MAX_KEPT_ERRORS]],
        requests=metrics,
    )



def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:.1f}"


def _s(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds:.2f}"


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_table(results: list[ServeResult]) -> str:
    """A markdown table, one row per result; latencies of runs with no completed request show "-"."""
    header = ["rate (req/s)", "requests", "failed", "req/s", "output tok/s",
              "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)",
              "TPOT mean (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)", "TPOT p99 (ms)", "e2e mean (s)", "e2e p99 (s)"]
    return markdown_table(header, [
        [format_rate(r.request_rate), r.num_requests, r.num_failed, f"{r.request_throughput:.2f}",
         f"{r.output_tokens_per_s:.1f}", *(_ms(s) for s in (r.ttft.mean, r.ttft.p50, r.ttft.p90, r.ttft.p99)),
         *(_ms(s) for s in (r.tpot.mean, r.tpot.p50, r.tpot.p90, r.tpot.p99)), _s(r.e2e.mean), _s(r.e2e.p99)]
        for r in results])

"""The fleet bench's per-run figures, its table and the goals it checks."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from pagedllm.bench.serve.results import MAX_KEPT_ERRORS, LatencyStats, RequestMetrics
from pagedllm.bench.tables import markdown_table

# The goals the prefix-aware router is held to (docs/distributed.md, "Benchmark: pagedllm bench fleet").
GOAL_HIT_VS_SINGLE = 0.90  # prefix run's cached prompt tokens / the one engine's, at least
GOAL_THROUGHPUT_VS_ROUND_ROBIN = 1.3  # total tok/s, at least
GOAL_TTFT_P50_VS_ROUND_ROBIN = 0.6  # at most

_REPLICA_UP = re.compile(r"^pagedllm:router_replica_up\{[^}]*\}\s+1(\.0)?\s*$", re.MULTILINE)


@dataclass(frozen=True)
class FleetResult:
    """One run: its policy name (``run``), its row label, every request's metrics and the seconds
    from the first send to the last completion. Token totals count the completed requests."""

    run: str
    label: str
    metrics: list[RequestMetrics]
    duration_s: float

    @property
    def done(self) -> list[RequestMetrics]:
        return [m for m in self.metrics if m.ok]

    @property
    def num_failed(self) -> int:
        return len(self.metrics) - len(self.done)

    @property
    def errors(self) -> list[str]:
        return [str(m.error) for m in self.metrics if not m.ok][:MAX_KEPT_ERRORS]

    @property
    def prompt_tokens(self) -> int:
        return sum(m.prompt_tokens for m in self.done)

    @property
    def cached_tokens(self) -> int:
        return sum(getattr(m, "cached_tokens", 0) for m in self.done)

    @property
    def output_tokens(self) -> int:
        return sum(m.output_tokens for m in self.done)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s

    @property
    def ttft(self) -> LatencyStats:
        return LatencyStats.of([m.ttft_s for m in self.done if m.ttft_s is not None])

    def summary_line(self) -> str:
        failed = f", {self.num_failed} failed (first: {self.errors[0]})" if self.num_failed else ""
        return (f"{len(self.metrics)} requests in {self.duration_s:.1f} s, {self.cached_tokens}/{self.prompt_tokens} "
                f"prompt tokens cached, {self.total_tokens_per_s:.0f} tok/s, TTFT p50 "
                f"{1000 * self.ttft.p50:.0f} ms{failed}")


def _ratio(value: float, base: float | None) -> str:
    if base is None or not base or math.isnan(value) or math.isnan(base):
        return "-"
    return f"{value / base:.2f}x"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:.0f}"


def _find(results: list[FleetResult], run: str) -> FleetResult | None:
    return next((result for result in results if result.run == run), None)


def fleet_table(results: list[FleetResult]) -> str:
    """One row per run, with the cached prompt tokens against the one engine's and the
    throughput and TTFT p50 against round-robin's ("-" where that run is missing)."""
    single, rr = _find(results, "single"), _find(results, "round-robin")
    header = ["run", "requests", "failed", "prompt tokens", "cached tokens", "hit ratio", "cached vs one engine",
              "output tok/s", "total tok/s", "total tok/s vs round-robin", "TTFT p50 (ms)", "TTFT p90 (ms)",
              "TTFT p50 vs round-robin", "duration (s)"]
    rows = [[r.label, len(r.metrics), r.num_failed, r.prompt_tokens, r.cached_tokens, f"{r.hit_ratio:.1%}",
             _ratio(r.cached_tokens, single and single.cached_tokens), f"{r.output_tokens_per_s:.1f}",
             f"{r.total_tokens_per_s:.0f}", _ratio(r.total_tokens_per_s, rr and rr.total_tokens_per_s),
             _ms(r.ttft.p50), _ms(r.ttft.p90), _ratio(r.ttft.p50, rr and rr.ttft.p50), f"{r.duration_s:.1f}"]
            for r in results]
    return markdown_table(header, rows)


def goals_text(results: list[FleetResult]) -> str:
    """The goals of the prefix run, each with what was measured and whether it was met."""
    prefix, single, rr = _find(results, "prefix"), _find(results, "single"), _find(results, "round-robin")
    if prefix is None:
        return "Goals: not checked (no prefix run)."
    lines = []
    checks = [(single, "cached prompt tokens vs the one engine's", "cached_tokens", GOAL_HIT_VS_SINGLE, True),
              (rr, "total tok/s vs round-robin", "total_tokens_per_s", GOAL_THROUGHPUT_VS_ROUND_ROBIN, True)]
    for base, what, attribute, goal, at_least in checks:
        if base is not None:
            ratio = getattr(prefix, attribute) / getattr(base, attribute) if getattr(base, attribute) else math.nan
            lines.append(_goal_line(what, ratio, goal, at_least))
    if rr is not None:
        lines.append(_goal_line("TTFT p50 vs round-robin", prefix.ttft.p50 / rr.ttft.p50, GOAL_TTFT_P50_VS_ROUND_ROBIN,
                                at_least=False))
    return "Goals of the prefix router:\n" + "\n".join(lines) if lines else "Goals: not checked (no baseline run)."


def _goal_line(what: str, ratio: float, goal: float, at_least: bool) -> str:
    met = ratio >= goal if at_least else ratio <= goal
    sign = ">=" if at_least else "<="
    return f"- {what}: {ratio:.2f}x (goal {sign} {goal:g}x): {'met' if met else 'NOT met'}"


def wait_for_replicas(base_url: str, replicas: int, timeout_s: float = 300.0) -> None:
    """Wait until the router's /metrics shows ``replicas`` replicas up (its /health is 200 as
    soon as one is); RuntimeError after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = httpx.get(f"{base_url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            text = ""
        if len(_REPLICA_UP.findall(text)) >= replicas:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}: fewer than {replicas} replicas up after {timeout_s:.0f} s")
        time.sleep(0.5)

"""The periodic serving log line (vLLM's ``LoggingStatLogger``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from pagedllm.logger import init_logger
from pagedllm.metrics.stats import IterationStats

logger = init_logger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0


class LoggingStatLogger:
    """Logs throughput and pool state at most every ``interval_s`` seconds
    while requests are in flight; silent while the engine is idle.

    The line is written from the engine's step, so it comes only when steps
    run; after an idle spell the window restarts at the next step, so a burst's
    throughput is not averaged over the idle time before it.
    """

    def __init__(self, interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"log stats interval must be a positive number of seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._idle = True
        self._window_start = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record(self, scheduler_stats: Mapping[str, Any], iteration: IterationStats) -> None:
        now = self._clock()
        if self._idle:
            self._restart_window(now)
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        in_flight = scheduler_stats["num_running"] + scheduler_stats["num_waiting"] + scheduler_stats["num_swapped"]
        self._idle = in_flight == 0
        elapsed = now - self._window_start
        if elapsed >= self.interval_s:
            logger.info(self.line(scheduler_stats, elapsed))
            self._restart_window(now)

    def line(self, stats: Mapping[str, Any], elapsed: float) -> str:
        return (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats['num_running']} reqs, Swapped: {stats['num_swapped']} reqs, "
            f"Pending: {stats['num_waiting']} reqs, "
            f"GPU KV cache usage: {100 * stats['num_blocks_in_use'] / stats['num_blocks']:.1f}%, "
            f"Prefix cache hit rate: {100 * _hit_rate(stats):.1f}%"
        )

    def _restart_window(self, now: float) -> None:
        self._window_start = now
        self._prompt_tokens = self._generation_tokens = 0


def _hit_rate(stats: Mapping[str, Any]) -> float:
    """Since start, in tokens (hits / queries)."""
    queries = stats["prefix_cache_queries"]
    return stats["prefix_cache_hits"] / queries if queries else 0.0

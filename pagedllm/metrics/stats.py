"""What the engine reports to its stat loggers after every step (vLLM's
``IterationStats`` / ``FinishedRequestStats``), as plain data.

The engine fills one ``IterationStats`` per step from what the step already
touches (the sequences that got a token, the requests that finished), so the
bookkeeping is O(advanced sequences), never O(all requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.outputs import RequestMetrics


@dataclass(frozen=True)
class FinishedRequestStats:
    """One request's life, reported once when it finishes (or is aborted).
    A phase the request never reached (aborted while queued) is None."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int  # every token sampled for it, all sequences
    max_generation_tokens: int | None  # the longest returned sequence (None: none returned)
    n: int
    max_tokens: int
    e2e_latency: float  # arrival -> finish
    queue_time: float | None  # arrival -> first scheduled
    prefill_time: float | None  # first scheduled -> first token
    decode_time: float | None  # first token -> last token
    inference_time: float | None  # first scheduled -> last token


@dataclass
class IterationStats:
    """One step's tokens and latencies, all measured at ``time``."""

    time: float
    num_prompt_tokens: int = 0  # prompts whose first token came this step, counted whole (as vLLM)
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # every gap, one per request per step
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def observe_tokens(self, metrics: RequestMetrics, num_prompt_tokens: int, num_new_tokens: int) -> None:
        """A request got ``num_new_tokens`` (over its sequences) this step."""
        if metrics.last_token_time is None:
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens.append(self.time - metrics.arrival_time)
            metrics.first_token_time = self.time
        else:
            self.inter_token_latencies.append(self.time - metrics.last_token_time)
        metrics.last_token_time = self.time
        metrics.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str, num_prompt_tokens: int,
                         generation_lengths: list[int], n: int, max_tokens: int) -> None:
        """A request left the engine; ``generation_lengths`` are its returned sequences' lengths."""
        metrics.finished_time = metrics.finished_time or self.time
        scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
        self.finished.append(FinishedRequestStats(
            finish_reason=finish_reason,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=metrics.num_generation_tokens,
            max_generation_tokens=max(generation_lengths) if generation_lengths else None,
            n=n,
            max_tokens=max_tokens,
            e2e_latency=self.time - metrics.arrival_time,
            queue_time=None if scheduled is None else scheduled - metrics.arrival_time,
            prefill_time=None if scheduled is None or first is None else first - scheduled,
            decode_time=None if first is None or last is None else last - first,
            inference_time=None if scheduled is None or last is None else last - scheduled,
        ))


@dataclass(frozen=True)
class MetricsContext:
    """What the loggers need to know about the engine once, at start."""

    model_name: str
    max_model_len: int
    cache_config: Mapping[str, str]  # the cache_config_info labels


class StatLogger(Protocol):
    """Receives the engine's counters (``LLMEngine.stats()``) and, after a
    step or an abort, that iteration's stats. Called from the engine's thread:
    implementations must be cheap and thread-safe against readers."""

    def record(self, scheduler_stats: Mapping[str, Any], iteration: IterationStats) -> None: ...

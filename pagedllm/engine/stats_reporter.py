"""The engine's side of metrics: each step's ``IterationStats``, built from
what the step already touched, handed to the stat loggers.

Safety rule: ``record`` runs in the engine's thread after a step or an abort;
the loggers it calls must only update their own counters (the Prometheus
registry is read concurrently by /metrics, which prometheus_client allows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from pagedllm.config.engine import EngineConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.runner_output import SampledTokens
from pagedllm.engine.user_request import UserRequest
from pagedllm.metrics import IterationStats, MetricsContext, PrometheusStatLogger, StatLogger
from pagedllm.outputs import RequestOutput
from pagedllm.worker.memory import PoolPlan


def metrics_context(config: EngineConfig, pool_plan: PoolPlan, scheduler_config: SchedulerConfig) -> MetricsContext:
    """The loggers' view of an engine: its default model name, lengths and cache configuration."""
    cache = config.cache
    cache_info = {
        "block_size": pool_plan.block_size, "cache_dtype": cache.kv_cache_dtype,
        "enable_prefix_caching": cache.enable_prefix_caching, "kv_layout": cache.kv_layout,
        "num_gpu_blocks": pool_plan.num_blocks, "num_cpu_blocks": pool_plan.num_swap_blocks,
        "swap_space": config.swap_space,
    }
    return MetricsContext(
        model_name=config.model or "SmolLM2-135M-Instruct", max_model_len=scheduler_config.max_model_len,
        cache_config={key: str(value) for key, value in cache_info.items()},
    )


class StatsReporter:
    """Owns the engine's Prometheus metrics (always on: ``LLM.get_metrics()``
    reads them) and any further loggers (the server's periodic log line)."""

    def __init__(self, context: MetricsContext, scheduler_stats: Callable[[], Mapping[str, Any]]) -> None:
        self.context = context
        self._scheduler_stats = scheduler_stats
        self.prometheus = PrometheusStatLogger(context)
        self.loggers: list[StatLogger] = []
        self.prometheus.record(scheduler_stats(), self.begin())  # the gauges show the empty pool from the start

    def configure(self, model_name: str, namespace: str) -> None:
        """Start fresh metrics under another served name and namespace (the server does this once, before serving)."""
        self.context = replace(self.context, model_name=model_name)
        self.prometheus = PrometheusStatLogger(self.context, namespace)
        self.prometheus.record(self._scheduler_stats(), self.begin())

    @staticmethod
    def begin() -> IterationStats:
        return IterationStats(time.time())

    @staticmethod
    def observe_advanced(iteration: IterationStats, advanced: list[Request],
                         states: Mapping[str, UserRequest], sampled: Mapping[str, SampledTokens]) -> None:
        """The sequences that got tokens this step, grouped by user request;
        ``sampled``: the runner's tokens per sequence (several for a speculating one)."""
        by_request: dict[str, tuple[int, int]] = {}
        for request in advanced:
            prompt_len, tokens = by_request.get(request.group_id, (len(request.prompt_token_ids), 0))
            own = sampled.get(request.request_id)  # (none for a pooling request: it pooled its prompt)
            by_request[request.group_id] = (prompt_len, tokens + (len(own.token_ids) if own is not None else 0))
        for request_id, (prompt_len, tokens) in by_request.items():
            iteration.observe_tokens(states[request_id].metrics, prompt_len, tokens)

    def observe_output(self, iteration: IterationStats, output: RequestOutput, state: UserRequest) -> None:
        """A request that finished with its last output."""
        if not isinstance(output.outputs, list):  # a pooling request's one pooled result: no tokens generated
            self._observe_end(iteration, state, "stop", [])
            return
        reason = output.outputs[0].finish_reason if output.outputs else "abort"
        self._observe_end(iteration, state, reason or "abort", [len(c.token_ids) for c in output.outputs])

    def observe_abort(self, iteration: IterationStats, state: UserRequest) -> None:
        self._observe_end(iteration, state, "abort", state.output_lengths())

    def _observe_end(self, iteration: IterationStats, state: UserRequest, reason: str,
                     lengths: list[int]) -> None:
        prompt_len = len(state.prompt_token_ids)
        max_tokens = state.params.max_tokens or self.context.max_model_len - prompt_len
        iteration.observe_finished(state.metrics, reason, prompt_len, lengths, state.num_completions, max_tokens)

    def record(self, iteration: IterationStats) -> None:
        stats = self._scheduler_stats()
        self.prometheus.record(stats, iteration)
        for logger in self.loggers:
            logger.record(stats, iteration)

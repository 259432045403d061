"""Prometheus metrics, named like vLLM's (``vllm:`` -> ``pagedllm:``) so dashboards carry over.

Gauges are refreshed from ``LLMEngine.stats()`` after every step; counters
follow the engine's cumulative counts; latency histograms are observed when a
request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pagedllm.outputs import RequestOutput

# Like vLLM: no *_created series next to every counter and histogram.
disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

# Metric name -> help text; the docs list these (docs/serving.md).
GAUGES = {
    "pagedllm:kv_cache_usage_perc": "Fraction of KV blocks in use by requests (0-1); cached free blocks not counted",
    "pagedllm:num_requests_running": "Sequences in the running batch",
    "pagedllm:num_requests_waiting": "Requests waiting (new or preempted)",
    "pagedllm:num_requests_swapped": "Requests swapped out to host memory",
    "pagedllm:kv_cache_free_blocks": "Free KV blocks (including cached, evictable ones)",
    "pagedllm:kv_cache_used_blocks": "KV blocks referenced by a request",
    "pagedllm:kv_cache_cached_blocks": "KV blocks holding a prefix-cache entry (used or free)",
    "pagedllm:kv_cache_total_blocks": "KV blocks in the pool",
}
# Counter name (without the _total suffix prometheus_client adds) -> (stats key, help).
COUNTERS = {
    "pagedllm:num_preemptions": ("num_preemptions", "Preemptions since start"),
    "pagedllm:prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "pagedllm:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
}


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges = {name: Gauge(name, text, registry=self.registry) for name, text in GAUGES.items()}
        self.counters = {
            name: (key, Counter(name, text, registry=self.registry)) for name, (key, text) in COUNTERS.items()
        }
        self._last_counts: dict[str, int] = {}
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter(
            "pagedllm:generation_tokens", "Generated tokens of finished requests", registry=self.registry
        )
        self.ttft = Histogram(
            "pagedllm:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "pagedllm:time_per_output_token_seconds", "Mean time per output token after the first",
            buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def update(self, stats: dict[str, int], outputs: list[RequestOutput]) -> None:
        total = stats["num_blocks"]
        used = stats["num_blocks_in_use"]
        values = {
            "pagedllm:kv_cache_usage_perc": used / total,
            "pagedllm:num_requests_running": stats["num_running"],
            "pagedllm:num_requests_waiting": stats["num_waiting"],
            "pagedllm:num_requests_swapped": stats["num_swapped"],
            "pagedllm:kv_cache_free_blocks": stats["num_free_blocks"],
            "pagedllm:kv_cache_used_blocks": used,
            "pagedllm:kv_cache_cached_blocks": stats["num_cached_blocks"],
            "pagedllm:kv_cache_total_blocks": total,
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        for name, (key, counter) in self.counters.items():
            delta = stats[key] - self._last_counts.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._last_counts[key] = stats[key]
        for output in outputs:
            if output.finished:
                self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(generated)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            tokens = max(len(c.token_ids) for c in output.outputs) if output.outputs else 0
            if m.finished_time is not None and tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (tokens - 1))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

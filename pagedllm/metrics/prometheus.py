"""Prometheus metrics under vLLM v1's names (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``), with ``pagedllm:`` or ``vllm:`` in front.

The default namespace is ``pagedllm``; ``--metrics-namespace vllm`` gives
exactly vLLM's names, so Grafana dashboards built for vLLM work unchanged.
Every engine metric carries a ``model_name`` label (the served name).
Gauges and the cumulative counters follow ``LLMEngine.stats()``; token
counters, first-token and inter-token latencies advance every step; the
request histograms are observed when a request finishes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pagedllm.core.kv_events import MEDIUM_DISK, MEDIUM_HOST
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats, MetricsContext

# Like vLLM: no *_created series next to every counter and histogram.
disable_created_metrics()

NAMESPACES = ("pagedllm", "vllm")

# vLLM v1's bucket boundaries.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's eager-mode iteration buckets (it uses its CUDA-graph sizes when it captures graphs).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# Name after the namespace -> help. Gauges read from LLMEngine.stats() each step.
GAUGES = {
    "num_requests_running": "Sequences in the running batch",
    "num_requests_waiting": "Requests waiting (new or preempted)",
    "num_requests_swapped": "Requests swapped out to host memory (vLLM v0's name; swap preemption exists here)",
    "kv_cache_usage_perc": "Fraction of KV blocks in use by requests (0-1); cached free blocks not counted",
    # Ours, beyond vLLM's list: the pool in blocks.
    "kv_cache_free_blocks": "Free KV blocks (including cached, evictable ones)",
    "kv_cache_used_blocks": "KV blocks referenced by a request",
    "kv_cache_cached_blocks": "KV blocks holding a prefix-cache entry (used or free)",
    "kv_cache_total_blocks": "KV blocks in the pool",
}
# Counters following a cumulative count of LLMEngine.stats(): name -> (stats key, help).
CUMULATIVE_COUNTERS = {
    "num_preemptions": ("num_preemptions", "Preemptions since start"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
}

# The tiers below the pool (present when the engine has them): name -> (stats key per medium, help);
# the medium label says it as the tiers' KV events do.
# ``external_prefix_cache_hits`` is vLLM's name for prompt tokens a KV connector supplied.
TIER_COUNTERS = {
    "kv_tier_hits": ({MEDIUM_HOST: "host_tier_hits", MEDIUM_DISK: "disk_tier_hits"},
                     "Prefix blocks loaded from a tier"),
    "kv_tier_stored_blocks": ({MEDIUM_HOST: "tier_offloads", MEDIUM_DISK: "tier_persists"},
                              "Blocks copied down to a tier (host: evicted from the pool; disk: first cached)"),
    "kv_tier_bytes_read": ({MEDIUM_HOST: "tier_loaded_bytes", MEDIUM_DISK: "disk_tier_bytes_read"},
                           "Bytes read from a tier (host: copied into the pool; disk: files read)"),
    "kv_tier_read_seconds": ({MEDIUM_HOST: "tier_load_seconds", MEDIUM_DISK: "disk_tier_read_seconds"},
                             "Seconds spent reading a tier (host: copies into the pool, on the step; disk: "
                             "reads and checks, on the reader thread)"),
}
# A vision-language engine's (present when it has an encoder cache): name -> (stats key, help).
ENCODER_COUNTERS = {
    "encoder_cache_hits": ("encoder_cache_hits", "Image encoder outputs found in the encoder cache"),
    "encoder_cache_misses": ("encoder_cache_misses", "Images run through the vision encoder (not in the cache)"),
    "mm_images_processed": ("mm_images_processed", "Images in the prompts of accepted requests"),
}
TIER_GAUGES = {"kv_tier_usage_bytes": ({MEDIUM_HOST: "host_tier_bytes", MEDIUM_DISK: "disk_tier_bytes"},
                                       "Bytes a tier holds now")}
BAD_FILE_REASONS = ("truncated", "corrupt", "foreign", "stale")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    """The metrics of one engine in their own registry (no process-global
    state: two engines in one process do not mix). ``/metrics`` serves
    ``registry``; ``LLM.get_metrics()`` reads it."""

    def __init__(self, context: MetricsContext, namespace: str = "pagedllm") -> None:
        if namespace not in NAMESPACES:
            raise ValueError(f"metrics namespace must be one of {', '.join(NAMESPACES)}, got {namespace!r}")
        self.namespace = namespace
        self.model_name = context.model_name
        self.registry = CollectorRegistry()
        self._last_counts: dict[str, int] = {}
        self.gauges = {key: self._labelled(Gauge, key, text) for key, text in GAUGES.items()}
        self.cumulative = {key: (stat, self._labelled(Counter, key, text))
                           for key, (stat, text) in CUMULATIVE_COUNTERS.items()}
        self.prompt_tokens = self._labelled(Counter, "prompt_tokens", "Prompt tokens processed (counted as each "
                                                                      "request's first token is sampled)")
        self.generation_tokens = self._labelled(Counter, "generation_tokens", "Tokens generated, every step")
        self.request_success = Counter(self.name("request_success"), "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self._add_histograms(context)
        info = Gauge(self.name("cache_config_info"), "Information of the KV cache configuration",
                     list(context.cache_config), registry=self.registry)
        info.labels(**context.cache_config).set(1)
        self._tier_metrics: dict[str, Any] | None = None  # made on the first stats that show tiers
        self._encoder_metrics: dict[str, Any] | None = None  # made on the first stats that show an encoder cache

    def name(self, suffix: str) -> str:
        return f"{self.namespace}:{suffix}"

    def _labelled(self, kind: type, suffix: str, text: str, **options: Any) -> Any:
        """A metric with the ``model_name`` label, already bound to this engine's name."""
        return kind(self.name(suffix), text, ["model_name"], registry=self.registry, **options).labels(
            model_name=self.model_name)

    def _add_histograms(self, context: MetricsContext) -> None:
        tokens = build_1_2_5_buckets(context.max_model_len)
        h = self._labelled
        self.request_prompt_tokens = h(Histogram, "request_prompt_tokens", "Prompt tokens per request", buckets=tokens)
        self.request_generation_tokens = h(Histogram, "request_generation_tokens", "Generated tokens per request",
                                           buckets=tokens)
        self.iteration_tokens = h(Histogram, "iteration_tokens_total", "Prompt + generated tokens per engine step",
                                  buckets=ITERATION_TOKEN_BUCKETS)
        self.max_generation_tokens = h(Histogram, "request_max_num_generation_tokens",
                                       "Generated tokens of a request's longest sequence", buckets=tokens)
        self.params_n = h(Histogram, "request_params_n", "The n request parameter", buckets=PARAMS_N_BUCKETS)
        self.params_max_tokens = h(Histogram, "request_params_max_tokens", "The max_tokens request parameter",
                                   buckets=tokens)
        self.ttft = h(Histogram, "time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS)
        self.itl = h(Histogram, "inter_token_latency_seconds", "Every gap between two tokens of a request",
                     buckets=ITL_BUCKETS)
        self.tpot = h(Histogram, "time_per_output_token_seconds",
                      "Deprecated alias of inter_token_latency_seconds (same observations, as vLLM)",
                      buckets=ITL_BUCKETS)
        self.phases = {
            "e2e_latency": h(Histogram, "e2e_request_latency_seconds", "Arrival to finish",
                             buckets=REQUEST_LATENCY_BUCKETS),
            "queue_time": h(Histogram, "request_queue_time_seconds", "Arrival to first scheduled",
                            buckets=REQUEST_LATENCY_BUCKETS),
            "inference_time": h(Histogram, "request_inference_time_seconds", "First scheduled to last token",
                                buckets=REQUEST_LATENCY_BUCKETS),
            "prefill_time": h(Histogram, "request_prefill_time_seconds", "First scheduled to first token",
                              buckets=REQUEST_LATENCY_BUCKETS),
            "decode_time": h(Histogram, "request_decode_time_seconds", "First token to last token",
                             buckets=REQUEST_LATENCY_BUCKETS),
        }

    def record(self, scheduler_stats: Mapping[str, Any], iteration: IterationStats) -> None:
        self._record_pool(scheduler_stats)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        tokens = iteration.num_prompt_tokens + iteration.num_generation_tokens
        if tokens:
            self.iteration_tokens.observe(tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
            self.tpot.observe(value)
        for finished in iteration.finished:
            self._record_finished(finished)

    def _record_pool(self, stats: Mapping[str, Any]) -> None:
        total, used = stats["num_blocks"], stats["num_blocks_in_use"]
        values = {
            "num_requests_running": stats["num_running"],
            "num_requests_waiting": stats["num_waiting"],
            "num_requests_swapped": stats["num_swapped"],
            "kv_cache_usage_perc": used / total,
            "kv_cache_free_blocks": stats["num_free_blocks"],
            "kv_cache_used_blocks": used,
            "kv_cache_cached_blocks": stats["num_cached_blocks"],
            "kv_cache_total_blocks": total,
        }
        for key, value in values.items():
            self.gauges[key].set(value)
        for stat, counter in self.cumulative.values():
            self._advance(counter, stat, stats[stat])
        self._record_tiers(stats)
        self._record_encoder(stats)

    def _record_encoder(self, stats: Mapping[str, Any]) -> None:
        if "encoder_cache_hits" not in stats:
            return
        if self._encoder_metrics is None:
            self._encoder_metrics = {name: self._labelled(Counter, name, text)
                                     for name, (_, text) in ENCODER_COUNTERS.items()}
            self._encoder_metrics["encoder_cache_usage_bytes"] = self._labelled(
                Gauge, "encoder_cache_usage_bytes", "Bytes of encoder outputs the encoder cache holds")
        for name, (key, _) in ENCODER_COUNTERS.items():
            self._advance(self._encoder_metrics[name], key, stats[key])
        self._encoder_metrics["encoder_cache_usage_bytes"].set(stats["encoder_cache_bytes"])

    def _record_tiers(self, stats: Mapping[str, Any]) -> None:
        """Per-medium tier counters and gauges, and vLLM's external_prefix_cache_hits (tokens)."""
        if "host_tier_capacity_bytes" not in stats:
            return
        if self._tier_metrics is None:
            labelled = {name: Counter(self.name(name), text, ["model_name", "medium"], registry=self.registry)
                        for name, (_, text) in TIER_COUNTERS.items()}
            labelled.update({name: Gauge(self.name(name), text, ["model_name", "medium"], registry=self.registry)
                             for name, (_, text) in TIER_GAUGES.items()})
            labelled["kv_tier_bad_files"] = Counter(
                self.name("kv_tier_bad_files"), "Disk tier files that failed their checks (recomputed), by reason",
                ["model_name", "reason"], registry=self.registry)
            labelled["external_prefix_cache_hits"] = self._labelled(
                Counter, "external_prefix_cache_hits", "Prompt tokens loaded from the tiers below the pool")
            self._tier_metrics = labelled
        metrics = self._tier_metrics
        for name, (keys, _) in TIER_COUNTERS.items():
            for medium, key in keys.items():
                if key in stats:
                    self._advance(metrics[name].labels(model_name=self.model_name, medium=medium), key, stats[key])
        for name, (keys, _) in TIER_GAUGES.items():
            for medium, key in keys.items():
                if key in stats:
                    metrics[name].labels(model_name=self.model_name, medium=medium).set(stats[key])
        for reason in BAD_FILE_REASONS:
            key = f"disk_tier_{reason}_files"
            if key in stats:
                self._advance(metrics["kv_tier_bad_files"].labels(model_name=self.model_name, reason=reason), key,
                              stats[key])
        self._advance(metrics["external_prefix_cache_hits"], "external_prefix_cache_hits", stats["tier_hit_tokens"])

    def _advance(self, counter: Any, key: str, total: float) -> None:
        """Bring a counter up to a cumulative ``total`` from the stats."""
        delta = total - self._last_counts.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_counts[key] = total

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=finished.finish_reason).inc()
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        if finished.max_generation_tokens is not None:
            self.max_generation_tokens.observe(finished.max_generation_tokens)
        self.params_n.observe(finished.n)
        self.params_max_tokens.observe(finished.max_tokens)
        for phase, histogram in self.phases.items():
            value = getattr(finished, phase)
            if value is not None:
                histogram.observe(value)

"""Engine metrics: per-step stats (``stats``), Prometheus (``prometheus``),
the periodic log line (``log_line``) and vLLM-shaped snapshots (``reader``)."""

from pagedllm.metrics.log_line import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats, MetricsContext, StatLogger

__all__ = ["IterationStats", "LoggingStatLogger", "MetricsContext", "PrometheusStatLogger", "StatLogger"]

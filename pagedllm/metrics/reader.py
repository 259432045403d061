"""A snapshot of a metrics registry as vLLM's ``vllm.v1.metrics.reader``
objects (what ``LLM.get_metrics()`` returns)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("+Inf" last) -> cumulative count


@dataclass
class Vector(Metric):
    """vLLM's per-position counters (speculative decoding); none here yet."""

    values: list[int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of ``registry``: one object per label set."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "histogram":
            metrics += _histograms(family)
            continue
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                metrics.append(Counter(family.name, dict(sample.labels), int(sample.value)))
            elif family.type == "gauge":
                metrics.append(Gauge(family.name, dict(sample.labels), float(sample.value)))
    return metrics


def _histograms(family) -> list[Histogram]:
    by_labels: dict[tuple, Histogram] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        histogram = by_labels.setdefault(key, Histogram(family.name, labels, 0, 0.0, {}))
        if sample.name.endswith("_bucket"):
            histogram.buckets[sample.labels["le"]] = int(sample.value)
        elif sample.name.endswith("_count"):
            histogram.count = int(sample.value)
        elif sample.name.endswith("_sum"):
            histogram.sum = float(sample.value)
    return list(by_labels.values())

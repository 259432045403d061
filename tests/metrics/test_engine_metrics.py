"""Engine metrics on a tiny model: counters advance every step, every
inter-token gap is observed, finish reasons are labelled, the periodic log
line, and LLM.get_metrics()."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.soak import metric_value
from pagedllm.metrics import LoggingStatLogger
from pagedllm.metrics.reader import Counter, Gauge, Histogram
from tests.conftest import assert_pool_free


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), num_kv_blocks=64)


def metrics_text(llm: LLM) -> str:
    return generate_latest(llm.llm_engine.stats_reporter.prometheus.registry).decode()


def value(llm: LLM, name: str, **labels: str) -> float:
    return metric_value(metrics_text(llm), name, **labels)


def test_token_counters_advance_every_step_not_at_finish(llm):
    engine = llm.llm_engine
    before_generated = value(llm, "pagedllm:generation_tokens_total")
    before_prompt = value(llm, "pagedllm:prompt_tokens_total")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("steps", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    seen = []
    while engine.has_unfinished_requests():
        finished = any(o.finished for o in engine.step())
        seen.append(value(llm, "pagedllm:generation_tokens_total") - before_generated)
        if len(seen) == 1:  # the prompt counts as soon as its first token is sampled
            assert value(llm, "pagedllm:prompt_tokens_total") - before_prompt == 5
        assert finished or seen[-1] < 8
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8]
    assert_pool_free(llm)


def test_every_inter_token_gap_is_observed_and_phases_once_per_request(llm):
    before = {name: value(llm, f"pagedllm:{name}_count") for name in (
        "inter_token_latency_seconds", "time_per_output_token_seconds", "time_to_first_token_seconds",
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds", "e2e_request_latency_seconds")}
    lengths = [3, 7]
    outs = llm.generate(["one", "two three"], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                              for n in lengths], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    delta = {name: value(llm, f"pagedllm:{name}_count") - count for name, count in before.items()}
    assert delta.pop("inter_token_latency_seconds") == sum(n - 1 for n in lengths)
    assert delta.pop("time_per_output_token_seconds") == sum(n - 1 for n in lengths)
    assert set(delta.values()) == {len(lengths)}, delta
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.num_generation_tokens == len(out.outputs[0].token_ids)
    assert_pool_free(llm)


def test_request_success_by_finish_reason_and_request_histograms(llm):
    def success(reason: str) -> float:
        try:
            return value(llm, "pagedllm:request_success_total", finished_reason=reason)
        except ValueError:
            return 0.0

    before = {reason: success(reason) for reason in ("length", "stop", "abort")}
    n_before = value(llm, "pagedllm:request_params_n_sum")
    llm.generate("x", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    first = llm.generate("y", SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    llm.generate("y", SamplingParams(max_tokens=5, temperature=0, stop_token_ids=first, n=2), use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("to-abort", "z", SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("to-abort")
    assert {reason: success(reason) - count for reason, count in before.items()} == {
        "length": 2, "stop": 1, "abort": 1}
    assert value(llm, "pagedllm:request_params_n_sum") - n_before == 1 + 1 + 2 + 1  # counted per request
    assert value(llm, "pagedllm:num_requests_running") == 0  # the abort refreshed the gauges
    assert_pool_free(llm)


def test_cache_config_info(llm):
    text = metrics_text(llm)
    assert metric_value(text, "pagedllm:cache_config_info", block_size="16", num_gpu_blocks="64",
                        enable_prefix_caching="True", cache_dtype="auto") == 1


def test_get_metrics_returns_vllm_shaped_objects(llm):
    outs = llm.generate(["a b", "c"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics() if "finished_reason" not in m.labels}
    generated = metrics["pagedllm:generation_tokens"]
    assert isinstance(generated, Counter) and generated.labels == {"model_name": llm.llm_engine.config.model}
    assert generated.value == value(llm, "pagedllm:generation_tokens_total") >= 8
    assert isinstance(metrics["pagedllm:kv_cache_usage_perc"], Gauge)
    itl = metrics["pagedllm:inter_token_latency_seconds"]
    assert isinstance(itl, Histogram) and itl.count >= 6 and itl.buckets["+Inf"] == itl.count
    assert all(o.finished for o in outs)
    assert_pool_free(llm)


def test_periodic_log_line_while_busy_only(llm, caplog):
    clock = iter(float(t) for t in range(1000))  # the fake clock moves one second per step
    log = LoggingStatLogger(interval_s=2.0, clock=lambda: next(clock))
    llm.llm_engine.stats_reporter.loggers.append(log)

    def log_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "pagedllm.metrics.log_line"]

    try:
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            llm.generate("hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
            lines = log_lines()
            # Steps at t=1..6: the window opens at the first step and a line comes every 2 s.
            assert len(lines) == 2, lines
            assert lines[0].startswith("Avg prompt throughput: 0.5 tokens/s, Avg generation throughput: 1.5 tokens/s, "
                                       "Running: 1 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: ")
            assert lines[1].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1.0 tokens/s")
            assert lines[1].endswith("Prefix cache hit rate: 0.0%")
            for _ in range(100):  # idle: no step, no line; the next burst starts a fresh window
                next(clock)
            llm.generate("hello", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
            assert log_lines() == lines
    finally:
        llm.llm_engine.stats_reporter.loggers.remove(log)
    assert_pool_free(llm)

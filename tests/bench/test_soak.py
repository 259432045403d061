"""`pagedllm bench soak` against a real server process on a tiny model."""

from __future__ import annotations

import pytest

from pagedllm.bench.soak import format_table, metric_value, run_soak


@pytest.mark.slow
def test_short_soak_has_no_errors_and_drains_to_zero_blocks(tiny_model_dir):
    # A small pool so that requests also get preempted while clients abort.
    result = run_soak(duration_s=8.0, concurrency=6, abort_fraction=0.5, seed=3,
                      server_args=["--model", tiny_model_dir("llama"), "--num-kv-blocks", "96"])
    assert result.errors == 0, result.error_samples
    assert result.completed > 0 and result.aborted > 0, result
    assert result.blocks_in_use_after_drain == 0
    assert result.rss_after_warmup_mib > 0 and result.rss_at_end_mib > 0
    assert "| 6 |" in format_table(result)


def test_metric_value_reads_unlabelled_samples():
    text = "# HELP x y\npagedllm:num_requests_running 3.0\npagedllm:kv_cache_used_blocks{a=\"b\"} 7.0\n"
    assert metric_value(text, "pagedllm:num_requests_running") == 3.0
    assert metric_value(text, "pagedllm:kv_cache_used_blocks") == 7.0

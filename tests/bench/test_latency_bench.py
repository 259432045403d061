"""`pagedllm bench latency`: the per-stream timings, the memory floor's arithmetic, the table,
what --compare llama.cpp says when it cannot run, and one run of the command on a tiny model
(two configurations, a few tokens) that records its table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagedllm.bench import commands, latency
from pagedllm.bench.cli import add_bench_parser
from pagedllm.bench.moe_llama import parse_decode_rates
from pagedllm.cli import main
from pagedllm.entrypoints import engine_args
from tests.conftest import assert_pool_free

# llama-batched-bench -npp 16 -ntg 8 -npl 1,2 on the embedded SmolLM2 Q4_1 GGUF (the 0.3.36 build).
LLAMA_OUTPUT = """llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    1.190 |    13.45 |    1.174 |     6.81 |    2.364 |    10.15 |
|    16 |      8 |    2 |     48 |    2.797 |    11.44 |    2.560 |     6.25 |    5.357 |     8.96 |
"""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "latency", *argv])


def test_stream_times_as_a_user_sees_them():
    # The second stream's last two tokens came out of one step (speculation): 0 apart.
    times = latency.StreamTimes(0.0, [[1.0, 1.5, 2.0], [1.2, 2.2, 2.2]])
    assert times.ttfts_s() == [1.0, 1.2]
    assert times.intervals_s() == pytest.approx([0.5, 0.5, 1.0, 0.0])
    assert times.decode_tokens_per_s() == pytest.approx(4 / 1.0)  # 1.5, 2.0, 2.2, 2.2 after both started at 1.2
    row = latency.LatencyRow.of(latency.LatencyConfig(2, 8, 3), times, load=1.5)
    assert (row.ms_p50, row.ttft_ms_p50) == (pytest.approx(500.0), pytest.approx(1100.0))


def test_floor_reads_the_weights_and_every_streams_kv_at_the_mean_context():
    floor = latency.MemoryFloor(weight_bytes=1000, kv_bytes_per_token=10, bandwidth_gbps=1e-6)  # 1,000 bytes/s
    config = latency.LatencyConfig(streams=2, prompt_len=100, output_len=50)
    assert floor.step_bytes(config) == 1000 + 2 * 10 * 125
    assert floor.ms_per_token(config) == pytest.approx(3500.0)


def test_table_with_llama_cpp_and_the_cold_start():
    configs = [latency.LatencyConfig(1, 128, 128), latency.LatencyConfig(8, 128, 128)]
    rows = [latency.LatencyRow(configs[0], 10.0, 12.5, 100.0, 300.0, 2.0, 50.0),
            latency.LatencyRow(configs[1], 20.0, 25.0, 400.0, 900.0, 3.0, None)]
    floor = latency.MemoryFloor(weight_bytes=2_000_000, kv_bytes_per_token=0, bandwidth_gbps=1.0)  # 2 ms a step
    llama = latency.LlamaSide("llama-batched-bench", Path("m.gguf"), threads=2)
    result = latency.LatencyResult("m.gguf, float32, 2 threads", rows, floor, built_s=3.25, cold_ttft_s=0.5,
                                   llama=llama)
    lines = latency.format_table(result).splitlines()
    assert lines[2] == "| 1 | 128 | 128 | 10.00 | 12.50 | 100.0 | 300 | 2.00 | 20% | 50.0 | 2.00x | 2.0 |"
    assert lines[3] == "| 8 | 128 | 128 | 20.00 | 25.00 | 400.0 | 900 | 2.00 | 10% | - | - | 3.0 |"
    assert "engine built in 3.2 s" in lines[-1] and "had its first token 500 ms later" in lines[-1]
    assert "-npl S -t 2` on m.gguf" in latency.describe(result)
    assert parse_decode_rates(LLAMA_OUTPUT) == {1: 6.81, 2: 6.25}


def test_compare_says_why_llama_cpp_did_not_run(tmp_path, monkeypatch):
    model = tmp_path / "model.Q4_1.gguf"
    args = _parse(["--compare", "llama.cpp", "--gguf-weights", "dequantize"])
    args.llama_batched_bench = None
    side, notes = latency.llama_side(args, model, threads=2)
    assert side.gguf == model and "dequantized it to float32" in notes[-1]
    assert latency.llama_side(_parse([]), model, 2) == (None, [])
    no_build = latency.LlamaSide(None, model, 2)
    assert "no llama-batched-bench found" in no_build.why_not()
    assert no_build.rate(latency.LatencyConfig(1, 8, 2)) is None
    assert "not a GGUF file" in latency.LlamaSide("bin", None, 2).why_not()
    failing = latency.LlamaSide(str(tmp_path / "no-such-binary"), model, 2)
    monkeypatch.setattr(latency, "llama_decode_rate", _failed_run)
    assert failing.rate(latency.LatencyConfig(8, 1024, 512)) is None
    assert failing.failures == ["llama.cpp failed on 8 x (1024 + 512): exit 1"]


def _failed_run(*_: object) -> float:
    raise RuntimeError("exit 1\nits output's tail")


def test_arguments_and_their_defaults():
    args = _parse([])
    assert args.func is commands.cmd_bench_latency
    assert (args.streams, args.prompt_len, args.output_len, args.compare) == ([1, 2, 4, 8], [128, 1024], [128, 512],
                                                                             None)
    assert len(latency.latency_configs(args.streams, args.prompt_len, args.output_len)) == 16
    with pytest.raises(SystemExit):
        _parse(["--streams", "0"])
    with pytest.raises(ValueError, match="--output-len 2 or more"):
        latency.latency_configs([1], [8], [1, 4])


def test_command_on_a_tiny_model_records_its_table(tiny_llama, tmp_path, capsys, monkeypatch):
    made = []
    monkeypatch.setattr(commands, "make_llm", lambda args, **o: made.append(engine_args.make_llm(args, **o))
                        or made[-1])
    record = tmp_path / "BENCH.md"
    main(["bench", "latency", "--model", tiny_llama, "--streams", "1", "2", "--prompt-len", "8", "--output-len", "3",
          "--num-kv-blocks", "32", "--compare", "llama.cpp", "--record", str(record)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [row.split("|")[1:4] for row in rows] == [[" 1 ", " 8 ", " 3 "], [" 2 ", " 8 ", " 3 "]]
    assert all(row.split("|")[-3].strip() == "-" for row in rows)  # no llama.cpp figure: not a GGUF
    text = record.read_text()
    assert "Machine: " in text and "bench latency" in text and "not a GGUF file" in text
    assert_pool_free(made[0])

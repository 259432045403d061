"""The `pagedllm` command: its engine flags, generate, run, serve and the benches, on a tiny model."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from pagedllm import LLM
from pagedllm.config.engine import NESTED_CONFIGS, CacheConfig, EngineConfig, engine_option_fields
from pagedllm.bench import cli as bench_cli
from pagedllm.bench import commands as bench_commands
from pagedllm.bench import throughput_command
from pagedllm.cli import build_parser, main
from pagedllm.entrypoints import cli as serving_cli
from pagedllm.entrypoints import engine_args
from pagedllm.model.packed_linear import packing_supported
from tests.conftest import assert_pool_free

# Every command that builds an engine, with the arguments it needs besides the flags.
ENGINE_COMMANDS = [
    ["run"], ["generate", "Hello"], ["serve"],
    *(["bench", name] for name in ("throughput", "sharing", "prefix", "rerank", "preemption", "roofline", "soak",
                                   "spec", "latency")),
]


@pytest.fixture(autouse=True)
def pool_is_free_after_each_command(monkeypatch):
    """Capture every LLM a command builds and check its pool once the command is done."""
    made = []
    real_make_llm = engine_args.make_llm

    def recording_make_llm(args, **overrides):
        made.append(real_make_llm(args, **overrides))
        return made[-1]

    for module in (serving_cli, bench_commands, throughput_command):
        monkeypatch.setattr(module, "make_llm", recording_make_llm)
    yield
    for llm in made:
        assert_pool_free(llm)


def engine_config_of(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(argv)
    return EngineConfig.from_options(**engine_args.engine_options_from_args(args))


def test_every_engine_option_has_a_flag_with_its_default_on_every_engine_command():
    options = engine_option_fields()
    # One flat name per field: a nested group's field (CacheConfig, LoRAConfig) may not shadow another.
    assert len(options) == len(fields(EngineConfig)) - len(NESTED_CONFIGS) + sum(
        len(fields(group)) for group in NESTED_CONFIGS.values())
    for name, option in options.items():
        assert option.metadata.get("help"), f"{name} has no help text"
    for command in ENGINE_COMMANDS:
        parsed = vars(build_parser().parse_args(command))
        assert {name: parsed.get(name, "missing") for name in options} == {
            name: option.default for name, option in options.items()}, command


def test_engine_flags_reach_the_config():
    config = engine_config_of([
        "serve", "--no-enable-chunked-prefill", "--kv-layout", "contiguous", "--contiguous-reservation", "request",
        "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5", "--max-model-len", "512",
        "--debug-invariants", "--distributed-timeout-s", "5",
    ])
    assert config.enable_chunked_prefill is False and config.max_model_len == 512 and config.debug_invariants
    assert config.distributed_timeout_s == 5.0
    cache = config.cache
    assert (cache.kv_layout, cache.contiguous_reservation, cache.enable_prefix_caching) == ("contiguous", "request", False)
    assert cache.gpu_memory_utilization == 0.5 and cache.num_kv_blocks is None
    config = engine_config_of(["run", "--long-prefill-token-threshold", "64", "--contiguous-reservation", "300"])
    assert config.long_prefill_token_threshold == 64 and config.enable_chunked_prefill is True
    assert config.cache.contiguous_reservation == 300


def test_a_bad_flag_value_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["run", "--contiguous-reservation", "lots"])
    assert exc.value.code == 2
    assert "--contiguous-reservation: expected one of: max_model_len, request, int; got 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--kv-layout", "striped"])
    assert "--kv-layout: expected one of: paged, contiguous; got 'striped'" in capsys.readouterr().err


def test_engine_flags_pass_on_to_a_child_server():
    args = build_parser().parse_args([
        "bench", "soak", "--num-kv-blocks", "96", "--no-enable-prefix-caching", "--contiguous-reservation", "request",
        "--long-prefill-token-threshold", "32", "--debug-invariants",
    ])
    flags = engine_args.engine_flags_from_args(args)
    # Only what differs from the defaults, in the options' order.
    assert flags == ["--long-prefill-token-threshold", "32", "--num-kv-blocks", "96", "--no-enable-prefix-caching",
                     "--contiguous-reservation", "request", "--debug-invariants"]
    assert engine_config_of(["serve", *flags]) == engine_config_of(["bench", "soak", *flags])


def test_llm_rejects_an_unknown_option():
    with pytest.raises(ValueError, match=r"unknown engine option 'foo'; the options are: model, .*block_size"):
        LLM(foo=1)


def test_engine_refusals_of_a_flag_combination_are_error_messages(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "Hello", "--model", tiny_model_dir("llama"), "--num-kv-blocks", "16",
              "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "64"])
    assert exc.value.code == 2
    assert "long_prefill_token_threshold needs enable_chunked_prefill=True" in capsys.readouterr().err


def test_serve_shows_the_capacity_line_once(tiny_model_dir, monkeypatch, capsys, caplog):
    served = {}
    monkeypatch.setattr("pagedllm.entrypoints.serve_setup.run_uvicorn",
                        lambda app, options, *_: served.update(options, app=app))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        main(["serve", "--model", tiny_model_dir("llama"), "--no-engine-process", "--num-kv-blocks", "16",
              "--port", "8123"])
        with TestClient(served["app"]) as client:  # the model loads once the server runs
            deadline = time.monotonic() + 60
            while client.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
    assert served["port"] == 8123
    assert "KV cache:" not in capsys.readouterr().out
    capacity_logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(capacity_logs) == 1 and capacity_logs[0].startswith("KV cache: 16 blocks x 16 tokens")


def test_generate_prints_the_completion(tiny_model_dir, capsys):
    main(["generate", "Hello", "--model", tiny_model_dir("llama"), "--max-tokens", "5", "--num-kv-blocks", "16"])
    out = capsys.readouterr().out
    assert out.strip() != ""


def test_run_prints_capacity_then_generations(tiny_model_dir, capsys):
    main(["run", "--model", tiny_model_dir("llama"), "--max-tokens", "4", "--num-kv-blocks", "32"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("KV cache: 32 blocks x 16 tokens = 512 tokens")
    assert out.count(">>> ") == 4
    assert "free now: 32" in out


def test_bad_engine_flag_is_an_error_message(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "Hello", "--model", tiny_model_dir("llama"), "--block-size", "3"])
    assert exc.value.code == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_throughput_against_hf_records_a_table(tiny_model_dir, tmp_path, capsys):
    dataset = tmp_path / "requests.json"
    dataset.write_text(json.dumps([{"prompt_token_ids": [300 + i] * (5 + i), "max_tokens": 3 + i} for i in range(4)]))
    record = tmp_path / "BENCH.md"
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--dataset", str(dataset),
        "--baseline", "hf", "--hf-batch-size", "2", "--num-kv-blocks", "32", "--record", str(record),
        "--dtype", "auto",  # resolved once, for this engine and the HF baseline alike
    ])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| pagedllm") or line.startswith("| hf generate")]
    # pagedllm, HF generate at batch 2, and HF's continuous batching (generate_batch).
    assert [row.split("|")[1].strip() for row in rows] == [
        "pagedllm (paged KV)", "hf generate (batch 2)", "hf generate_batch (continuous, paged)"]
    assert "vs Hugging Face `generate` (best batch size): **" in out
    assert "vs Hugging Face continuous batching (`generate_batch`): **" in out
    # 4 requests, 5+6+7+8 prompt tokens, 3+4+5+6 output tokens, for every engine.
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == ["4", "26", "18"]
    assert "| pagedllm (paged KV) |" in record.read_text()
    assert "--baseline hf" in record.read_text()


def test_bench_sharing_reports_the_saving(tiny_model_dir, tmp_path, capsys):
    record = tmp_path / "BENCH.md"
    main([
        "bench", "sharing", "--model", tiny_model_dir("llama"), "--prompt-len", "100", "--output-len", "8",
        "--n", "1", "4", "--beam-width", "2", "--num-kv-blocks", "64", "--record", str(record),
    ])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| n=") or line.startswith("| beam")}
    assert set(rows) == {"n=1", "n=4", "beam width 2"}
    # n=1 forks nothing: the same blocks either way (7 blocks for 108 tokens).
    assert rows["n=1"][1].startswith("7 ") and rows["n=1"][2].startswith("7 ")
    # n=4: the 100-token prompt (6 full blocks + a tail) is stored once instead of four times.
    shared, unshared = int(rows["n=4"][1].split()[0]), int(rows["n=4"][2].split()[0])
    assert shared <= 7 + 4 and unshared >= 4 * 7
    assert "beam width 2" in record.read_text()


def test_bench_differential_runs_selected_beam_cases(tiny_model_dir, tmp_path, capsys):
    record = tmp_path / "BENCH.md"
    main([
        "bench", "differential", "--model", tiny_model_dir("llama"), "--cases", "beam", "--only", "W=2 ",
        "--num-prompts", "2", "--max-tokens", "4", "--num-kv-blocks", "64", "--record", str(record),
    ])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| beam W=2 ")]
    assert len(rows) == 2 and all("| 2 | 100.0% | 100.0% |" in row for row in rows)
    text = record.read_text()
    assert "`pagedllm bench differential --model " in text and "beam W=2 ignore_eos" in text


def test_bench_differential_says_how_to_run_the_harness_where_it_is_not_installed(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "DIFFERENTIAL_CLI", "pagedllm_dev_absent.differential.cli")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "differential", "--cases", "beam"])
    assert exc.value.code == 2
    assert "`python -m pagedllm_dev.differential` with the same flags" in capsys.readouterr().err


def test_the_pagedllm_command_imports_no_development_code_nor_a_bench_client():
    """Building every parser of `pagedllm` (bench included), as every command does, loads no
    dev package and not the HTTP client of `bench serve` (httpx: ~0.15 s of a first generate)."""
    code = ("import sys; from pagedllm.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pagedllm_dev', 'tests', 'httpx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bench_prefix_compares_caching_on_and_off(tiny_model_dir, capsys):
    main([
        "bench", "prefix", "--model", tiny_model_dir("llama"), "--num-prompts", "4", "--system-len", "64",
        "--question-min", "4", "--question-max", "8", "--output-len", "3", "--num-kv-blocks", "64",
    ])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| on") or line.startswith("| off")}
    computed_on, total = map(int, rows["on"][1].split(" of "))
    computed_off, total_off = map(int, rows["off"][1].split(" of "))
    assert total == total_off and computed_off == total
    # The first request computes the 64-token prefix; the other three reuse its 4 blocks.
    assert computed_on == total - 3 * 64
    assert rows["off"][2] == "0.0%"


@pytest.mark.slow
def test_bench_preemption_compares_recompute_and_swap(tiny_model_dir, capsys):
    main([
        "bench", "preemption", "--model", tiny_model_dir("llama"), "--prompt-len", "40",
        "--output-len", "40", "--num-prompts", "6",
    ])
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 |")]
    assert [r[1] for r in rows] == ["recompute", "swap"]
    recompute, swap = rows
    assert int(recompute[3]) > 0 and int(recompute[4]) > 0 and recompute[5] == "0"
    assert int(swap[3]) > 0 and int(swap[5]) > 0 and swap[4] == "0"


def test_bench_throughput_against_contiguous_kv(tiny_model_dir, capsys):
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "8", "--input-len", "20",
        "--output-len", "12", "--baseline", "contiguous", "--num-kv-blocks", "32", "--max-model-len", "128",
    ])
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| pagedllm"))}
    paged, contiguous = rows["pagedllm (paged KV)"], rows["pagedllm (contiguous KV)"]
    assert paged[1:4] == contiguous[1:4] == ["8", "160", "96"]
    # 32 blocks hold 4 reservations of 128 tokens but all 8 paged requests (2 blocks each).
    assert float(paged[8]) > float(contiguous[8])
    assert float(contiguous[8]) <= 4


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| workload") and not line.startswith("|---")]


def test_bench_spec_compares_speculation_with_the_plain_engine(tiny_model_dir, tmp_path, capsys):
    record = tmp_path / "bench.md"
    main(["bench", "spec", "--model", tiny_model_dir("llama"), "--output-len", "12", "--num-mixed", "4",
          "--num-kv-blocks", "512", "--record", str(record)])
    (repetitive, open_ended, mixed) = table_rows(capsys.readouterr().out)
    assert repetitive[0].startswith("repetitive") and repetitive[1] == "12" and mixed[1] == "4"
    assert open_ended[0].startswith("open-ended") and open_ended[1] == "8"
    assert float(repetitive[4]) > 0 and float(repetitive[5]) > 0 and repetitive[6].endswith("x")
    # Decode-only speed (first token to last, prefill left out) and its ratio.
    plain_decode, speculative_decode = (float(v) for v in repetitive[7].split(","))
    assert plain_decode > 0 and speculative_decode > 0
    assert abs(float(repetitive[8].rstrip("x")) - speculative_decode / plain_decode) < 0.02
    assert "speculative decoding" in record.read_text().lower()


def test_bench_throughput_async_against_synchronous_steps(tiny_model_dir, capsys):
    main(["bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "6", "--input-len", "16",
          "--output-len", "10", "--async-scheduling", "--baseline", "sync", "--num-kv-blocks", "64"])
    out = capsys.readouterr().out
    assert "| pagedllm (async scheduling) |" in out and "| pagedllm (synchronous steps) |" in out


def test_bench_throughput_int8_kv_against_auto_at_the_same_memory(tiny_model_dir, capsys):
    # 160 KiB: 20 fp32 blocks of 16 tokens for the tiny model (8 KiB each), or 64 int8 blocks
    # (2.5 KiB each), of which a running sequence's full-precision tail takes 4.
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "8", "--input-len", "40",
        "--output-len", "20", "--kv-cache-dtype", "int8", "--baseline", "kv-auto",
        "--kv-cache-memory", str(160 * 1024), "--max-model-len", "128", "--max-num-seqs", "8",
    ])
    lines = capsys.readouterr().out.splitlines()
    pools = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
             for line in lines if line.startswith("| pagedllm") and line.count("|") == 9)}
    int8, auto = pools["pagedllm (int8 KV)"], pools["pagedllm (auto KV, float32)"]
    assert (int8[1], int8[2]) == ("160", "64") and (auto[1], auto[2]) == ("512", "20")
    # 8 requests of 60 tokens need 4 blocks each (3 at admission), and int8 a tail of 4 more:
    # int8 runs all 8 at once, fp32 at most 6.
    assert int(int8[5]) == 8 and int(auto[5]) <= 6
    assert int(auto[7]) >= int(int8[7])


def test_bench_kv_tiers_reports_hits_and_the_restart(tiny_model_dir, capsys, tmp_path):
    record = tmp_path / "bench.md"
    main(["bench", "kv-tiers", "--model", tiny_model_dir("llama"), "--num-conversations", "4", "--turns", "2",
          "--system-len", "64", "--turn-len", "8", "--output-len", "4", "--concurrency", "2",
          "--num-kv-blocks", "16", "--restart-prompt-len", "100", "--record", str(record)])
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| "))}
    # Second turns reuse each conversation's 4 full blocks (64 of its 72 + 4 tokens); the 16-block pool
    # has evicted some of them by then, every tier brings them back.
    none_hits = int(rows["none"][1].split(" of ")[0])
    for label in ("host", "disk", "host + disk"):
        assert rows[label][1] == "256 of 624" and rows[label][8] == "yes", rows[label]
    assert none_hits < 256
    assert rows["host"][7] == f"{(256 - none_hits) // 16} / 0" and rows["disk"][7] == f"0 / {(256 - none_hits) // 16}"
    assert rows["after a restart, from disk"][3] == "96" and rows["after a restart, from disk"][4] == "yes"
    assert "Reused prefixes" in record.read_text() and "after a restart" in record.read_text()


def pagedllm_rows(lines: list[str]) -> dict[str, list[str]]:
    """The cells of a bench table's pagedllm rows, by engine label."""
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
            for line in lines if line.startswith("| pagedllm"))}


def test_bench_throughput_two_ranks_against_one(tiny_model_dir, capsys):
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "4", "--input-len", "16",
        "--output-len", "8", "--tensor-parallel-size", "2", "--baseline", "tp1", "--num-kv-blocks", "32",
    ])
    lines = capsys.readouterr().out.splitlines()
    rows = pagedllm_rows(lines)
    assert rows["pagedllm (2 ranks)"][1:4] == rows["pagedllm (1 rank)"][1:4] == ["4", "64", "32"]
    traffic = next(line for line in lines if line.startswith("tensor parallel (2 ranks)"))
    # The tiny model: 2 layers, hidden 64, fp32.
    assert "all-reduce payload 1.0 KiB per token (2 x 2 layers x 64 x 4 bytes)" in traffic


def test_bench_throughput_bfloat16_against_float32(tiny_model_dir, capsys):
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "4", "--input-len", "24",
        "--output-len", "8", "--dtype", "bfloat16", "--baseline", "fp32", "--num-kv-blocks", "32",
    ])
    lines = capsys.readouterr().out.splitlines()
    rows = pagedllm_rows(lines)
    assert rows["pagedllm (bfloat16)"][1:4] == rows["pagedllm (float32)"][1:4] == ["4", "96", "32"]
    assert rows["pagedllm (float32)"][-1] == "1.00x"


def test_bench_throughput_fp32_baseline_needs_another_dtype(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--model", tiny_model_dir("llama"), "--baseline", "fp32"])
    assert exit_info.value.code == 2
    assert "--baseline fp32 compares a lower-precision dtype with fp32: pass --dtype bfloat16" in capsys.readouterr().err


def test_bench_throughput_plots_the_pool_at_its_fullest(tiny_model_dir, capsys, tmp_path):
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "6", "--input-len", "40",
        "--output-len", "10", "--num-kv-blocks", "64", "--plot", str(tmp_path),
    ])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pool at its fullest: "))
    path = tmp_path / "kv_pool.png"
    assert line.endswith(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_peak_snapshot_sees_every_request_at_once(tiny_model_dir):
    from pagedllm import LLM
    from pagedllm.bench.pool_plot import peak_pool_snapshot
    from pagedllm.bench.throughput import BenchRequest

    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64)
    requests = [BenchRequest([300 + 7 * i + j for j in range(40)], 20) for i in range(6)]
    snapshot = peak_pool_snapshot(llm, requests)
    # 6 running requests past 48 tokens (taken after a step, so before the last ones finish): 4 blocks each.
    assert snapshot["counters"]["blocks_in_use"] == 24
    assert len({o for b in snapshot["blocks"] for o in b["owners"]}) == 6
    assert llm.stats()["num_blocks_in_use"] == 0


@pytest.mark.slow
def test_bench_throughput_mixed_workload_reports_the_step_split(tiny_model_dir, capsys):
    main([
        "bench", "throughput", "--model", tiny_model_dir("llama"), "--dataset", "mixed", "--num-prompts", "6",
        "--baseline", "hf", "--hf-batch-size", "2", "3", "--num-kv-blocks", "128",
    ])
    out = capsys.readouterr().out
    static = [line for line in out.splitlines() if line.startswith("| hf generate (batch")]
    continuous = [line for line in out.splitlines() if line.startswith("| hf generate_batch")]
    assert len(static) == 2 and len(continuous) == 1
    assert "1.00x" in "".join(static + continuous)  # the fastest Hugging Face run is the baseline
    split = next(line for line in out.splitlines() if line.startswith("pagedllm step time:"))
    shares = [float(x) for x in re.findall(r"([\d.]+)%", split)]
    assert len(shares) == 4 and abs(sum(shares) - 100) < 0.5


def test_bench_attention_and_roofline_print_tables(tiny_model_dir, capsys):
    main(["bench", "attention", "--batch", "2", "--context", "40"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 | 40 |"))
    assert row.count("|") == 7
    main(["bench", "attention", "--prefill", "40"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 |"))
    fp32_ms, bf16_ms, cpp_ms = (float(c) for c in [c.strip() for c in row.strip("|").split("|")][1:4])
    assert fp32_ms > 0 and bf16_ms > 0 and cpp_ms > 0
    main(["bench", "linear", "--model", tiny_model_dir("llama"), "--batch", "3", "8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 3 |", "| 8 |"))]
    assert len(rows) == 2
    for row in rows:  # rows | PyTorch ms | C++ ms | speed-up (+ packed ms and its speed-ups), all measured
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert len(cells) == (6 if packing_supported(torch.device("cpu"), torch.float32) else 3)
        assert all(float(c.rstrip("x")) > 0 for c in cells)
    main(["bench", "linear", "--model", tiny_model_dir("llama"), "--batch", "3", "--dtype", "bfloat16"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    # + the packed kernel's ms and its speed-ups where the engine packs bf16 weights here
    assert len(cells) == (6 if packing_supported(torch.device("cpu"), torch.bfloat16) else 3)
    assert all(float(c.rstrip("x")) > 0 for c in cells)
    main(["bench", "roofline", "--model", tiny_model_dir("llama"), "--batch-size", "4", "--prompt-len", "8",
          "--decode-tokens", "4", "--num-kv-blocks", "32"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| float32 | 4 |"))
    gflops, bound, best, median = (float(c) for c in [c.strip() for c in row.strip("|").split("|")][2:6])
    assert gflops > 0 and bound > 0 and best >= median > 0


def test_bench_roofline_mixed_splits_the_workload_by_phase(tiny_model_dir, capsys):
    from pagedllm.bench.throughput import mixed_requests

    model = tiny_model_dir("llama")
    main(["bench", "roofline", "--dataset", "mixed", "--num-prompts", "5", "--model", model])
    lines = capsys.readouterr().out.splitlines()
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines
                                              if line.startswith("| ") and "phase" not in line)}
    assert set(rows) == {"steps with prompt tokens", "decode-only steps", "whole workload"}
    prefill, decode, whole = (rows[name] for name in ("steps with prompt tokens", "decode-only steps", "whole workload"))
    assert int(prefill[0]) + int(decode[0]) == int(whole[0])  # steps
    assert int(prefill[1]) + int(decode[1]) == int(whole[1])  # tokens
    # every request feeds its prompt and all but its last output token through the forward
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    requests = mixed_requests(5, vocab_size, seed=0)
    assert int(whole[1]) == sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in requests)
    for cells in rows.values():
        engine_s, floor_s = float(cells[2]), float(cells[5])
        assert engine_s > 0 and floor_s > 0
        assert float(cells[6].rstrip("%")) == pytest.approx(100 * floor_s / engine_s, abs=2)  # floor / engine


def test_roofline_floor_is_the_larger_of_compute_and_memory():
    from pagedllm.bench.phases import Roof

    roof = Roof(gflops=100.0, read_gbps=10.0, weight_bytes=10**9)
    assert roof.floor_s(1e9) == pytest.approx(0.1)  # memory-bound: 1 GB at 10 GB/s
    assert roof.floor_s(1e12) == pytest.approx(10.0)  # compute-bound: 1 TFLOP at 100 GFLOP/s

"""`pagedllm bench fragmentation`: the toy allocator's numbers, external fragmentation, the
default trace's waste and the block-size sweep, the plots and the record."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from pagedllm.bench.fragmentation import cli
from pagedllm.bench.fragmentation.pool import PoolSpec
from pagedllm.bench.fragmentation.replay import simulate
from pagedllm.bench.fragmentation.report import SWEEP_BLOCK_SIZES, FragmentationReport, run_fragmentation
from pagedllm.bench.fragmentation.traces import TraceRequest, sharegpt_like_trace

# The four requests of the reference toy allocator (shared/reference/002, "paged_allocator.py").
TOY = [
    {"prompt_len": 40, "output_len": 12},
    {"prompt_len": 17, "output_len": 3},
    {"prompt_len": 95, "output_len": 40},
    {"prompt_len": 8, "output_len": 200},
]
TOY_FLAGS = ["--num-blocks", "64", "--block-size", "16", "--max-model-len", "256"]

# Pool of 16 blocks x 4 slots, next-power-of-two reservations. At step 0 contiguous places r0..r3
# (16 slots each) and fills the pool; r0 and r2 leave after one step, so from step 2 two
# 16-slot holes are free: 32 slots, enough for r4's 32-slot reservation in total but not in
# any one hole, until r1 and r3 leave at step 15. Paged fits all five at step 0 (11 blocks).
EXTERNAL_TRACE = [
    TraceRequest(15, 1),
    TraceRequest(1, 15),
    TraceRequest(15, 1),
    TraceRequest(1, 15),
    TraceRequest(1, 31),
]
EXTERNAL_SPEC = PoolSpec(num_blocks=16, block_size=4, max_model_len=64, reservation="pow2")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.build_arg_parser(parser)
    args = parser.parse_args(argv)
    args.argv = ["bench", "fragmentation", *argv]
    return args


@pytest.fixture
def toy_path(tmp_path: Path) -> Path:
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(TOY), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def default_report() -> FragmentationReport:
    """The default trace in the default pool, as `pagedllm bench fragmentation` runs it."""
    args = parse([])
    trace = sharegpt_like_trace(args.num_requests, args.max_model_len, args.seed)
    spec = PoolSpec(args.num_blocks, args.block_size, args.max_model_len, args.reservation)
    return run_fragmentation(trace, spec)


def test_toy_through_main_json(toy_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(parse(["--dataset", str(toy_path), *TOY_FLAGS, "--json"]))
    report = json.loads(capsys.readouterr().out)
    assert round(report["contiguous"]["waste_percent"]) == 59
    assert round(report["paged"]["waste_percent"]) == 7
    for layout in ("contiguous", "paged"):
        assert (report[layout]["served"], report[layout]["rejected"]) == (4, 0)
        assert report[layout]["max_concurrent"] == 4
    assert [row["block_size"] for row in report["block_size_sweep"]] == list(SWEEP_BLOCK_SIZES)


def test_toy_through_python() -> None:
    trace = [TraceRequest(r["prompt_len"], r["output_len"]) for r in TOY]
    report = run_fragmentation(trace, PoolSpec(num_blocks=64, block_size=16, max_model_len=256))
    contiguous, paged = report.results["contiguous"], report.results["paged"]
    # The toy's own figures: 1024 slots reserved and 448 held for 415 tokens.
    assert (contiguous.held_slots, paged.held_slots, paged.needed_slots) == (1024, 448, 415)
    assert (round(contiguous.waste_percent), round(paged.waste_percent)) == (59, 7)
    assert contiguous.served == paged.served == 4


def test_external_fragmentation_delays_contiguous_only() -> None:
    contiguous = simulate(EXTERNAL_TRACE, EXTERNAL_SPEC, "contiguous")
    paged = simulate(EXTERNAL_TRACE, EXTERNAL_SPEC, "paged")
    assert contiguous.delayed == 1
    assert contiguous.external_fragmentation_steps == 14  # steps 2..15
    assert contiguous.external_percent > 0
    assert paged.delayed == 0
    assert paged.external_fragmentation_steps == 0 and paged.external_percent == 0
    assert contiguous.served == paged.served == 5


def test_default_trace_waste_in_paper_range(default_report: FragmentationReport) -> None:
    contiguous, paged = default_report.results["contiguous"], default_report.results["paged"]
    assert 60 <= contiguous.waste_percent <= 80
    assert paged.waste_percent < 5
    assert contiguous.served == paged.served == default_report.num_requests
    assert paged.max_concurrent > contiguous.max_concurrent
    # Equal max_model_len reservations are whole runs apart, so no hole is ever too small.
    assert contiguous.external_percent == 0


def test_sweep_trades_waste_for_table_entries(default_report: FragmentationReport) -> None:
    rows = default_report.sweep
    waste = [row.paged_waste_percent for row in rows]
    entries = [row.paged_table_entries for row in rows]
    assert waste == sorted(waste) and len(set(waste)) == len(waste)
    assert entries == sorted(entries, reverse=True) and len(set(entries)) == len(entries)
    assert {row.num_blocks * row.block_size for row in rows} == {default_report.spec.num_slots}


def test_sweep_matches_the_replay(default_report: FragmentationReport) -> None:
    """The sweep computes waste from final lengths; at the replayed block size it must agree."""
    (row,) = [row for row in default_report.sweep if row.block_size == default_report.spec.block_size]
    replay = default_report.results
    assert row.contiguous_waste_percent == pytest.approx(replay["contiguous"].waste_percent)
    assert row.paged_waste_percent == pytest.approx(replay["paged"].waste_percent)
    assert row.paged_table_entries == pytest.approx(replay["paged"].mean_table_entries)


def test_plot_writes_three_pngs(toy_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    cli.main(parse(["--dataset", str(toy_path), *TOY_FLAGS, "--json", "--plot", str(out)]))
    json.loads(capsys.readouterr().out)  # --json still prints only JSON
    for name in ("waste_vs_block_size.png", "memory_map.png", "batch_size.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 1024


def test_a_plot_without_matplotlib_names_the_bench_extra(toy_path: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """matplotlib is the optional ``bench`` extra: without it (an import that fails, as when it
    is not installed) ``--plot`` stops before the replay with a message naming the extra."""
    from pagedllm.bench.pool_plot import write_pool_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'pagedllm[bench]'")):
        cli.main(parse(["--dataset", str(toy_path), *TOY_FLAGS, "--plot", str(tmp_path / "plots")]))
    assert capsys.readouterr().out == "" and not (tmp_path / "plots").exists()  # nothing ran
    with pytest.raises(ImportError, match=re.escape("pip install 'pagedllm[bench]'")):
        write_pool_plot({"blocks": []}, tmp_path)


def test_record_appends_section(toy_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "BENCH.md"
    cli.main(parse(["--dataset", str(toy_path), *TOY_FLAGS, "--record", str(record)]))
    printed = capsys.readouterr().out
    text = record.read_text(encoding="utf-8")
    assert text.startswith("\n### ") and "`pagedllm bench fragmentation --dataset " in text
    assert "| contiguous | 59.5% |" in text and "| paged | 7.4% |" in printed


def test_rejects_what_never_fits() -> None:
    trace = [TraceRequest(10, 10), TraceRequest(60, 10)]
    spec = PoolSpec(num_blocks=4, block_size=16, max_model_len=128)
    contiguous = simulate(trace, spec, "contiguous")
    paged = simulate(trace, spec, "paged")
    # A 128-token reservation never fits 64 slots; paged serves what its blocks can hold.
    assert (contiguous.served, contiguous.rejected) == (0, 2)
    assert (paged.served, paged.rejected) == (1, 1)


def test_paged_preempts_when_every_request_stalls() -> None:
    # Two requests whose prompts fill the 2-block pool: both stall at the block boundary, the
    # later one is preempted and finishes after the first.
    trace = [TraceRequest(4, 4), TraceRequest(4, 4)]
    result = simulate(trace, PoolSpec(num_blocks=2, block_size=4, max_model_len=8), "paged")
    assert result.preempted >= 1
    assert result.served == 2 and result.waste_percent == 0


@pytest.mark.parametrize("flags", [["--arrival-rate", "inf"], ["--arrival-rate", "0"], ["--block-size", "24"],
                                   ["--block-size", "0"], ["--num-blocks", "many"]])
def test_cli_refuses_what_the_replay_cannot_run(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(flags)

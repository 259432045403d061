"""`pagedllm bench hybrid-kv` on tiny random models (a Gemma 3 for the KV measurements, the tiny
Llama for w1): the command line parses into the bench and its tables have a row per length,
the concurrency row and both modes' throughput."""

from __future__ import annotations

import argparse

from pagedllm.bench import commands
from pagedllm.bench.cli import add_bench_parser


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "hybrid-kv", *argv])
    args.argv, args.program = argv, "pagedllm"
    return args


def test_bench_tables(tiny_gemma_dir, tiny_llama, capsys):
    folder, _ = tiny_gemma_dir("gemma3")
    args = _args(["--model", folder, "--lengths", "16", "64", "--measure-up-to", "16", "--kv-cache-memory",
                  str(1 << 20), "--concurrent-len", "128", "--num-seqs", "6", "--output-len", "2",
                  "--throughput-model", tiny_llama, "--num-prompts", "3", "--rounds", "1"])
    assert args.func is commands.cmd_bench_hybrid_kv
    args.func(args)
    out = capsys.readouterr().out
    assert "| 16 |" in out and "measured (peak during prefill)" in out
    assert "| 64 |" in out and "layout arithmetic (> 16 not run)" in out
    concurrency = next(line for line in out.splitlines() if line.startswith("| 128 | 1 | 6 |"))
    hybrid, no_hybrid = (int(cell) for cell in concurrency.split("|")[4:6])
    assert hybrid >= no_hybrid >= 1
    assert "| hybrid |" in out and "| no hybrid |" in out and "llama" in out

"""`pagedllm bench lora` on the tiny random Llama: the command line parses into the bench,
the adapters it writes are what the engine's reader accepts, and the table has a row
per run with every adapter paged in at least once."""

from __future__ import annotations

import argparse

from pagedllm.bench.cli import add_bench_parser
from pagedllm.bench.lora import cli
from pagedllm.bench.lora.adapters import write_adapters
from pagedllm.lora.adapter_files import read_adapter


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "lora", *argv])
    args.argv, args.program = argv, "pagedllm"
    return args


def test_written_adapters_are_read_back(tiny_llama, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    first, again = (write_adapters(str(tmp_path), config, 2, 4, ("q_proj", "down_proj")) for _ in range(2))
    assert first == again  # the second call reuses the folders
    weights = read_adapter(first[1], config, 4)
    assert weights.rank == 4 and set(weights.target_modules) == {"q_proj", "down_proj"}
    assert len(weights.tensors) == 2 * config.num_hidden_layers


def test_bench_rows_and_page_ins(tiny_llama, tmp_path, capsys):
    args = _args(["--model", tiny_llama, "--num-adapters", "2,5", "--rank", "4", "--num-prompts", "6",
                  "--max-tokens", "4", "--adapter-dir", str(tmp_path)])
    assert args.func is cli.main
    bench = cli.measure(args)
    assert [run.label for run in bench.runs] == ["base (first)", "2 adapters", "5 adapters", "base (last)"]
    for run in bench.runs[1:-1]:
        assert run.adapters_used == run.num_adapters
        assert run.page_ins >= run.num_adapters
        assert run.num_blocks == bench.base_blocks + 8 * bench.pages_per_adapter
        assert run.result.output_tokens == 6 * 4
    assert bench.page_in is not None and bench.page_in.load_ms > 0
    table = cli.format_table(bench)
    lines = table.splitlines()
    assert lines[0].startswith("| run | adapters | adapters used | pool blocks | total tok/s | vs base | page-ins |")
    assert len(lines) == 2 + 4
    assert "Page-in alone" in cli.summary(bench)

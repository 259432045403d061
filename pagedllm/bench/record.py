"""Appending a benchmark result to BENCHMARKS.md (or any file): the command that
produced it, a line about the setup, and the table. No torch import, so the
bookkeeping-only benches stay light."""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def append_result(path: str, argv: list[str] | None, preamble: str, table: str, program: str = "pagedllm") -> None:
    """``argv`` are the command-line words after ``program`` (``sys.argv[1:]`` when None)."""
    words = sys.argv[1:] if argv is None else argv
    command = " ".join([program, *(shlex.quote(word) for word in words)])
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"\n### {datetime.date.today().isoformat()}: `{command}`\n\n{preamble}\n\n{table}\n")


def report(args: argparse.Namespace, table: str, setup: str, device: torch.device | None = None) -> None:
    """Print a bench's table; with --record also append it to that file, after
    the machine it ran on and ``setup`` (what was measured, how)."""
    from pagedllm.bench.throughput import machine_description

    print(table)
    if args.record:
        append_result(args.record, args.argv, f"Machine: {machine_description(device)}. {setup}", table, args.program)


def cpu_description() -> str:
    """The CPU's model name and the AVX-512 / VNNI / AMX flags it has (optimisations rank
    differently per CPU, so every record names it)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = sorted(f for f in set(flags) if f.startswith(("avx512f", "avx512_vnni", "avx512_bf16", "amx", "avx_vnni")))
    # The clock the kernel reports: the same model name has come at very different speeds.
    mhz = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cpu MHz")), None)
    clock = f" at {float(mhz):.0f} MHz" if mhz else ""
    amx = "" if any(f.startswith("amx") for f in wanted) else ", no AMX"
    return f"{model}{clock}, {multiprocessing.cpu_count()} CPUs, flags: {' '.join(wanted) or 'no AVX-512'}{amx}"

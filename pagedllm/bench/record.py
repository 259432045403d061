"""Appending a benchmark result to BENCHMARKS.md (or any file): the command that
produced it, a line about the setup, and the table. No torch import, so the
bookkeeping-only benches stay light."""

from __future__ import annotations

import datetime
import shlex
import sys


def append_result(path: str, argv: list[str] | None, preamble: str, table: str) -> None:
    """``argv`` are the CLI words after ``pagedllm`` (``sys.argv[1:]`` when None)."""
    words = sys.argv[1:] if argv is None else argv
    command = "pagedllm " + " ".join(shlex.quote(word) for word in words)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"\n### {datetime.date.today().isoformat()}: `{command}`\n\n{preamble}\n\n{table}\n")

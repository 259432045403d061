"""The Markdown tables the benches print and record."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """``| a | b |`` lines: the header, the ``|---|`` rule, then one line per row
    (each cell as ``str`` writes it)."""
    lines = [_line(header), "|" + "---|" * len(header)]
    lines += [_line(row) for row in rows]
    return "\n".join(lines)


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"

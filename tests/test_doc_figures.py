"""The size figures the README and docs/architecture.md state, recomputed from the tree:
a figure may round (a doc says "about"), but one more than 10% off fails with the
figure to write instead, so no hand-kept number drifts the way 6,800 / 18,000 lines had
(issue 54: 9,444 / 29,591 by then). Every "N lines" in README.md and docs/ must be one
of the figures checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pagedllm"
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu"}  # as tests/test_code_limits.py counts sources
TOLERANCE = 0.10


def _lines(paths: list[Path]) -> int:
    return sum(len(path.read_text().splitlines()) for path in paths)


def _sources(*folders: str) -> list[Path]:
    roots = [PACKAGE / folder for folder in folders] or [PACKAGE]
    return [path for root in roots for path in root.rglob("*")
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts]


def reading_path() -> list[Path]:
    """The files of docs/architecture.md's "Reading path" table."""
    section = (ROOT / "docs" / "architecture.md").read_text().split("## Reading path", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`[^|]*`) \|", section, re.M)
    return [PACKAGE / name for row in rows for name in re.findall(r"`([^`]+\.py)`", row)]


# What each figure counts.
MEASURES = {
    "reading path files": lambda: len(reading_path()),
    "reading path lines": lambda: _lines(reading_path()),
    "core, engine and worker lines": lambda: _lines(_sources("core", "engine", "worker")),
    "package lines": lambda: _lines(_sources()),
}
# (document, the sentence with its figures as groups, what each group measures). Whitespace in a
# document matches any run of whitespace (a sentence may wrap).
FIGURES = [
    ("README.md", r"its reading path is (\d+) files, about ([\d,]+) lines",
     ("reading path files", "reading path lines")),
    ("README.md", r"all of `core/`, `engine/` and `worker/` \([^)]*\) is about ([\d,]+), and the whole package, "
                  r"with the models, kernels, server and benchmarks, about ([\d,]+)",
     ("core, engine and worker lines", "package lines")),
    ("docs/architecture.md", r"is these (\d+) files \(about ([\d,]+) lines",
     ("reading path files", "reading path lines")),
    ("docs/architecture.md", r"`core/`, `engine/` and `worker/` as a whole are about ([\d,]+) lines; "
                             r"the package is about ([\d,]+)",
     ("core, engine and worker lines", "package lines")),
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize(("document", "pattern", "measures"), FIGURES)
def test_a_stated_figure_is_within_ten_percent_of_the_tree(document, pattern, measures):
    match = re.search(pattern, _flat((ROOT / document).read_text()))
    assert match, f"{document}: the sentence with the figures changed; update tests/test_doc_figures.py"
    for stated, measure in zip(match.groups(), measures):
        actual = MEASURES[measure]()
        stated_value = int(stated.replace(",", ""))
        exact = measure.endswith("files")  # a count of files is exact, a count of lines "about"
        assert (stated_value == actual) if exact else abs(stated_value - actual) <= TOLERANCE * actual, (
            f"{document} says {stated} {measure.split()[-1]} ({measure}); the tree has {actual:,}: write "
            f"{actual if exact else f'{round(actual, -2):,}'}")


def test_every_line_count_in_the_docs_is_checked():
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = {(document, pattern) for document, pattern, _ in FIGURES}
    unchecked = []
    for path in documents:
        name = str(path.relative_to(ROOT))
        text = _flat(path.read_text())
        covered = [m.span() for doc, pattern in checked if doc == name for m in re.finditer(pattern, text)]
        for figure in re.finditer(r"\b\d[\d,]* lines\b", text):
            if not any(start <= figure.start() < end for start, end in covered):
                unchecked.append(f"{name}: ...{text[max(0, figure.start() - 60):figure.end()]}")
    assert not unchecked, "line counts no test checks (add them to FIGURES or remove them):\n" + "\n".join(unchecked)

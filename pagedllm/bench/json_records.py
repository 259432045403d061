"""Reading a benchmark's input file: a non-empty JSON list of records. No torch
import, so the bookkeeping-only benches stay light."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

Record = TypeVar("Record")


def read_json_records(path: str, fields: str, parse: Callable[[Any], Record]) -> list[Record]:
    """``parse`` applied to each item of the JSON list in ``path``. ValueError, naming
    the file and the expected ``fields``, when the list is empty or not a list, or
    when ``parse`` fails on an item (a missing key, a value of the wrong type)."""
    with open(path, encoding="utf-8") as f:
        items = json.load(f)
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of {{{fields}}}")
    try:
        return [parse(item) for item in items]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: every item needs {fields} ({exc})") from exc

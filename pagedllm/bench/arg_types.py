"""argparse types the benches share: counts and rates that must be positive."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """A count that must be at least 1."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def positive_rate(text: str) -> float:
    """A rate per second or per step: a positive float, "inf" (all at once) included."""
    try:
        rate = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not rate > 0:  # written this way round so NaN is refused too
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return rate


def positive_finite_rate(text: str) -> float:
    """A positive rate that is not "inf"."""
    rate = positive_rate(text)
    if math.isinf(rate):
        raise argparse.ArgumentTypeError(f"must be finite: {text!r}")
    return rate


def positive_int_list(text: str) -> list[int]:
    """Comma-separated counts, each at least 1 (``1,8,64,256``)."""
    words = [word.strip() for word in text.split(",") if word.strip()]
    if not words:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}")
    return [positive_int(word) for word in words]

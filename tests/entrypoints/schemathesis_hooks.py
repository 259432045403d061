"""Schemathesis hooks for the fuzz runs of the server (tests/entrypoints/test_openapi_schemathesis.py,
and the longer run in docs/security.md), loaded through tests/entrypoints/schemathesis.toml.

A valid generated request is adjusted in two ways, each keeping it valid:
- it asks for at most ``LONGEST`` tokens (one asking for none gets the server's
  default, ``--override-generation-config``), so a run stays short;
- its whole numbers are sent as JSON integers: JSON Schema counts ``2.0`` as an
  integer, but this server takes an integer field only as an integer (a float
  or a boolean is a 400), so ``2.0`` would test that rule, not the request.
Invalid requests go out as generated: the server must refuse them before any
token is generated."""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis import Case, HookContext

LONGEST = 8
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens")


def _integers_as_integers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_integers_as_integers(item) for item in value]
    if isinstance(value, dict):
        return {key: _integers_as_integers(item) for key, item in value.items()}
    return value


@schemathesis.hook
def before_call(context: HookContext, case: Case, kwargs: dict[str, Any]) -> None:
    """Right before sending, so that every case is seen, however it was made (a
    ``map_case`` hook misses some of the fuzzing phase's: a run met one asking
    for 500 tokens); schemathesis re-checks the case's validity after it."""
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return
    case.body = _integers_as_integers(case.body)
    for name in LENGTH_FIELDS:
        value = case.body.get(name)
        if type(value) is int and value > LONGEST:
            case.body[name] = LONGEST

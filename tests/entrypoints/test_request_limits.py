"""Bounded by construction: the log of ignored unknown request fields keeps a
bounded set of names, and one request's work is capped by
``--max-tokens-per-request`` (a 400 naming the field to lower and the flag)."""

from __future__ import annotations

from unittest import mock

from pagedllm.entrypoints.openai import protocol
from pagedllm.entrypoints.openai.protocol import CompletionRequest, IgnoredFieldLog


def _lines(log: mock.Mock) -> list[str]:
    return [call.args[0] % call.args[1:] for call in log.warning.call_args_list]


def test_the_ignored_field_log_remembers_a_bounded_set_of_names():
    log = mock.Mock()
    ignored = IgnoredFieldLog(limit=3, log=log)
    for name in ("a", "b", "a", "c", "b"):
        ignored("CompletionRequest", name)
    ignored("ChatCompletionRequest", "a")  # another request kind: another name
    ignored("CompletionRequest", "d")
    for i in range(1000):
        ignored("CompletionRequest", f"fuzzed{i}")
    lines = _lines(log)
    assert lines[:3] == ["CompletionRequest: ignoring the unknown field 'a'",
                         "CompletionRequest: ignoring the unknown field 'b'",
                         "CompletionRequest: ignoring the unknown field 'c'"]
    assert len(lines) == 4 and "further unknown fields are ignored without being logged" in lines[3]
    assert len(ignored._seen) == 3


def test_a_long_unknown_name_is_logged_shortened():
    log = mock.Mock()
    IgnoredFieldLog(log=log)("CompletionRequest", "x" * 10_000)
    (line,) = _lines(log)
    assert len(line) < 200 and line.endswith("...'")


def test_request_models_log_unknown_fields_through_the_bounded_log(monkeypatch):
    log = mock.Mock()
    monkeypatch.setattr(protocol, "_log_ignored_field", IgnoredFieldLog(limit=2, log=log))
    for i in range(5):
        CompletionRequest.model_validate({"prompt": "hi", f"unknown{i}": 1, "unknown0": 2})
    lines = _lines(log)
    assert lines == ["CompletionRequest: ignoring the unknown field 'unknown0'",
                     "CompletionRequest: ignoring the unknown field 'unknown1'",
                     "2 unknown request fields were logged; further unknown fields are ignored without being logged"]

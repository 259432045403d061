"""A live server fuzzed with the request fields of structured output, tools,
echo and the token rules, valid and not: every answer is a 200 or an
OpenAI-shaped 4xx, the server stays up, and no KV block stays in use."""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.bench.server_process import running_server
from pagedllm.bench.soak import metric_value

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
          "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = ["--model", tiny_llama, "--served-model-name", MODEL, "--num-kv-blocks", "128",
            "--chat-template", "hermes", "--uvicorn-log-level", "warning", "--host", "127.0.0.1"]
    with running_server(args, start_timeout_s=120) as (base, _pid):
        yield base


def _junk():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(-200, 200, allow_nan=False),
                        st.text(max_size=6))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=5), inner, max_size=3), max_leaves=5)


def _new_fields() -> dict:
    """Each new field: valid values, values that must be refused, and junk."""
    junk = _junk()
    return {
        "response_format": st.one_of(st.sampled_from([
            {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": 3}}},
            {"type": "yaml"}]), junk),
        "structured_outputs": st.one_of(st.sampled_from([
            {"regex": "[ab]{1,3}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "x" | "y"'}, {"regex": "("},
            {"grammar": "root ::= nothing"}, {"json": SCHEMA, "regex": "a"}, {}]), junk),
        "guided_json": st.sampled_from([SCHEMA, "{not json", None]),
        "guided_choice": st.one_of(st.sampled_from([["a", "b"], [], None]), junk),
        "guided_decoding_backend": st.sampled_from(["xgrammar", "outlines", None]),
        "logit_bias": st.one_of(st.sampled_from([{"42": 100}, {"-1": 5}, {"99999999": 1}, {"7": "x"}]), junk),
        "allowed_token_ids": st.one_of(st.sampled_from([[1, 2, 3], [], [-1], [10**9]]), junk),
        "bad_words": st.one_of(st.sampled_from([["the"], [""], ["a b c"]]), junk),
        "truncate_prompt_tokens": st.sampled_from([None, -1, 0, 2, 10**6, -7]),
        "echo": st.booleans(),
        "suffix": st.sampled_from([None, "tail"]),
        "prompt_logprobs": st.sampled_from([None, 0, 2, 21, -1]),
        "return_tokens_as_token_ids": st.booleans(),
        "logprobs": st.sampled_from([None, 0, 2, 21, True]),
        "top_logprobs": st.sampled_from([None, 0, 3, 21]),
        "tools": st.one_of(st.sampled_from([[TOOL], [], [{"type": "function"}]]), junk),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", {"type": "function", "function": {
            "name": "get_weather"}}, {"type": "function", "function": {"name": "missing"}}]), junk),
        "parallel_tool_calls": st.booleans(),
        "continue_final_message": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "chat_template_kwargs": st.one_of(st.sampled_from([{"enable_thinking": False}, {"tools": 1}]), junk),
        "functions": st.sampled_from([None, [], [{"name": "f"}]]),
        "n": st.sampled_from([1, 2]),
        "stream": st.booleans(),
        "temperature": st.sampled_from([0, 0.8]),
        "unknown_field_xyz": junk,
    }


def _bodies(path: str):
    messages = st.sampled_from([
        [{"role": "user", "content": "Weather in Paris?"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    ])
    # max_tokens is always small: a fuzzed body must not run to max_model_len.
    required = {"model": st.just(MODEL), "max_tokens": st.sampled_from([0, 1, 4, 8])}
    if path == "/v1/completions":
        required["prompt"] = st.sampled_from(["The weather", [5, 6, 7, 8], ["a", "b"]])
    else:
        required["messages"] = messages
    return st.fixed_dictionaries(required, optional=_new_fields())


def _used_blocks(base: str) -> float:
    return metric_value(httpx.get(f"{base}/metrics").text, "pagedllm:kv_cache_used_blocks")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_new_fields_never_get_a_5xx_or_leak(server, path):
    statuses = []

    @settings(max_examples=70, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=_bodies(path))
    def check(body):
        response = httpx.post(f"{server}{path}", json=body, timeout=120)
        statuses.append(response.status_code)
        assert response.status_code in (200, 400), (body, response.status_code, response.text[:400])
        if response.status_code == 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", error

    check()
    assert 200 in statuses and 400 in statuses  # the fuzz reached both outcomes
    assert httpx.get(f"{server}/health").status_code == 200
    deadline = time.time() + 30
    while _used_blocks(server):
        assert time.time() < deadline, "a fuzzed request still holds KV blocks"
        time.sleep(0.2)

"""Structured output over HTTP: response_format, structured_outputs and the
guided_* fields on both endpoints, streamed and not, and the 400s of invalid
constraints. A server on a tiny random model: only the mask makes its output valid."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from pagedllm.bench.server_process import running_server
from pagedllm.bench.soak import metric_value

MODEL = "tiny"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = ["--model", tiny_llama, "--served-model-name", MODEL, "--num-kv-blocks", "256"]
    with running_server(args, start_timeout_s=180) as (base, _pid):
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def assert_pool_free(base: str) -> None:
    """The server's equivalent of assert_pool_free: nothing running, no block held."""
    deadline = time.time() + 60
    while True:
        metrics = httpx.get(f"{base}/metrics").text
        if not metric_value(metrics, "pagedllm:num_requests_running") and not metric_value(
                metrics, "pagedllm:kv_cache_used_blocks"):
            break
        assert time.time() < deadline, "requests still hold blocks"
        time.sleep(0.2)
    assert metric_value(metrics, "pagedllm:num_requests_waiting") == 0


def test_chat_response_format_json_schema_streamed_and_not(server):
    c = client(server)
    full = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                                     response_format=RESPONSE_FORMAT)
    content = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), PERSON)
    stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                                       response_format=RESPONSE_FORMAT, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == content
    sampled = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=1.0, seed=4,
                                        n=3, response_format=RESPONSE_FORMAT)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert_pool_free(server)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
        ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
        ({"guided_regex": r"\d{3}-\d{4}"}, lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
        ({"guided_choice": ["red", "green"]}, lambda text: text in ("red", "green")),
        ({"guided_grammar": 'root ::= "x" [a-c]{1,4} "!"'}, lambda text: re.fullmatch(r"x[a-c]{1,4}!", text)),
        ({"structured_outputs": {"regex": "(ab|cd){2}"}, "guided_decoding_backend": "xgrammar"},
         lambda text: re.fullmatch("(ab|cd){2}", text)),
    ],
)
def test_completions_follow_every_kind_of_constraint(server, extra, check):
    c = client(server)
    # json_object is unbounded: random weights need not close it, so only a finished output must parse.
    max_tokens = 40 if "response_format" in extra else 150
    result = c.completions.create(model=MODEL, prompt="Answer:", max_tokens=max_tokens, temperature=0,
                                  extra_body=extra)
    choice = result.choices[0]
    if choice.finish_reason == "stop":
        assert check(choice.text), choice.text
    else:
        assert "response_format" in extra and choice.text.startswith("{")
    streamed = c.completions.create(model=MODEL, prompt="Answer:", max_tokens=max_tokens, temperature=0,
                                    extra_body=extra, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    assert_pool_free(server)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 3}}}},
         "response_format", "response_format is invalid: properties must be an object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "needs json_schema.schema"),
        ({"guided_json": {"type": "strnig"}}, "guided_json", 'guided_json is invalid: Unsupported type "strnig"'),
        ({"guided_regex": "(ab"}, "guided_regex", "guided_regex is invalid: .*parenthesis"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "guided_grammar is invalid"),
        ({"guided_choice": []}, "guided_choice", "at least 1 item"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "response_format and guided_regex each constrain the output; send only one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "cannot be combined with structured_outputs"),
        ({"guided_json": {}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "disable_any_whitespace"),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(server, body, param, message):
    for path, payload in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": MESSAGES})):
        response = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, "max_tokens": 5, **payload, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and re.search(message, error["message"]), error
        assert set(error) == {"message", "type", "param", "code"}
    assert_pool_free(server)


def test_a_misspelt_structured_outputs_key_is_a_400_not_ignored(server):
    response = httpx.post(f"{server}/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "structured_outputs": {"regx": "a+"}})
    assert response.status_code == 400 and "regx" in response.json()["error"]["message"]
    text = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                        "response_format": {"type": "text"}})
    assert text.status_code == 200
    assert_pool_free(server)

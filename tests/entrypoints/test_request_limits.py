"""Bounded by construction: the log of ignored unknown request fields keeps a
bounded set of names, and one request's work is capped by
``--max-tokens-per-request`` (a 400 naming the field to lower and the flag)."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.common import request_fields
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.common.limits import DEFAULT_MAX_TOKENS_PER_REQUEST
from pagedllm.entrypoints.openai.common.protocol import CompletionRequest, IgnoredFieldLog
from tests.conftest import assert_pool_free_once_idle

CAP = 100
MAX_MODEL_LEN = 256


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
    monkeypatch.setattr(request_fields, "_log_ignored_field", IgnoredFieldLog(limit=2, log=log))
    for i in range(5):
        CompletionRequest.model_validate({"prompt": "hi", f"unknown{i}": 1, "unknown0": 2})
    lines = _lines(log)
    assert lines == ["CompletionRequest: ignoring the unknown field 'unknown0'",
                     "CompletionRequest: ignoring the unknown field 'unknown1'",
                     "2 unknown request fields were logged; further unknown fields are ignored without being logged"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)


@pytest.fixture(scope="module")
def client(llm):
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name="tiny",
                        max_tokens_per_request=CAP)
    with TestClient(build_app(state)) as test_client:
        yield test_client


@pytest.fixture(autouse=True)
def pool_is_free_afterwards(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_free_once_idle(request.getfixturevalue("llm"))


IDS = list(range(100, 110))  # a prompt of 10 tokens
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "param", "asked"), [
    # 10 prompt tokens + 4 sequences x 30 tokens
    ("/v1/completions", {"prompt": IDS, "n": 4, "max_tokens": 30}, "n", 130),
    ("/v1/completions", {"prompt": IDS, "n": 1, "best_of": 3, "max_tokens": 40}, "best_of", 130),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 200}, "max_tokens", 210),
    # max_tokens null: until the context is full (256 - 10 tokens)
    ("/v1/completions", {"prompt": IDS, "max_tokens": None}, "max_tokens", MAX_MODEL_LEN),
    ("/v1/completions", {"prompt": [IDS] * 5, "max_tokens": 11}, "prompt", 5 * (10 + 11)),
    # echo with logprobs over a long prompt: each of the 2 choices carries the 60 prompt tokens' logprobs
    ("/v1/completions", {"prompt": list(range(100, 160)), "n": 2, "max_tokens": 1, "echo": True, "logprobs": 1},
     "n", 60 * 2 + 2),
    ("/v1/completions", {"prompt": list(range(100, 160)), "n": 2, "max_tokens": 1, "prompt_logprobs": 0},
     "n", 60 * 2 + 2),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 3, "max_tokens": 30}, "n", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 200}, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200}, "max_tokens", None),
])
def test_a_request_over_the_work_cap_is_a_400_naming_the_field_and_the_flag(client, path, body, param, asked):
    response = client.post(path, json={"temperature": 0, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert f"more than the {CAP} this server allows per request (--max-tokens-per-request)" in error["message"]
    if asked is not None:
        assert f"asks for up to {asked} tokens" in error["message"], error["message"]


def test_the_responses_and_messages_apis_are_capped_alike(client):
    responses = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 200, "temperature": 0})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "max_output_tokens", responses.text
    messages = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 200, "messages": MESSAGES})
    error = messages.json()
    assert messages.status_code == 400 and error["type"] == "error", messages.text
    assert error["error"]["type"] == "invalid_request_error" and "--max-tokens-per-request" in error["error"]["message"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": IDS, "n": 3, "max_tokens": 30}),  # exactly 10 + 3 x 30
    ("/v1/completions", {"prompt": list(range(100, 160)), "n": 2, "max_tokens": 20, "echo": True}),  # no logprobs
    ("/v1/completions", {"prompt": list(range(100, 160)), "n": 1, "max_tokens": 40, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": [IDS] * 4, "max_tokens": 15}),  # 4 x (10 + 15)
    # truncate_prompt_tokens counts the tokens kept: 10 of 200
    ("/v1/completions", {"prompt": list(range(100, 300)), "truncate_prompt_tokens": 10, "n": 3, "max_tokens": 30}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 8}),
])
def test_a_request_within_the_cap_runs(client, path, body):
    response = client.post(path, json={"temperature": 0, **body})
    assert response.status_code == 200, response.text


def test_a_prompt_too_long_for_the_model_is_refused_for_its_length_not_the_cap(client):
    error = client.post("/v1/completions", json={"prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 1}).json()["error"]
    assert "max_model_len" in error["message"] and "--max-tokens-per-request" not in error["message"]


def test_the_default_cap_is_16384_or_max_model_len_if_longer(llm):
    engine = AsyncLLMEngine(llm.llm_engine)
    assert ServerState(async_engine=engine, served_model_name="t").request_token_cap == DEFAULT_MAX_TOKENS_PER_REQUEST
    assert ServerState(async_engine=engine, served_model_name="t", max_tokens_per_request=7).request_token_cap == 7
    with pytest.raises(ValueError, match="--max-tokens-per-request must be at least 1"):
        ServerState(async_engine=engine, served_model_name="t", max_tokens_per_request=0)
    info = llm.llm_engine
    from dataclasses import replace

    from pagedllm.engine.engine_info import EngineInfo
    from pagedllm.entrypoints.openai.common.limits import max_tokens_per_request

    long_context = replace(EngineInfo.of(info), max_model_len=131072)
    assert max_tokens_per_request(long_context, None) == 131072


def test_serve_passes_the_flag_to_the_server(serve):
    app, _, _ = serve("--max-tokens-per-request", "40", "--max-model-len", "128")
    with TestClient(app) as client:  # the model loads once the server runs
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        response = client.post("/v1/completions", json={"prompt": IDS, "n": 2, "max_tokens": 16})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
        assert client.post("/v1/completions", json={"prompt": IDS, "n": 2, "max_tokens": 15}).status_code == 200
        document = client.get("/openapi.json").json()
    assert "40" in document["components"]["schemas"]["CompletionRequest"]["description"]

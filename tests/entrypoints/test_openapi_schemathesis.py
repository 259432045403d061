"""Schemathesis, a third-party fuzzer, against the server's own /openapi.json:
a live server (uvicorn in a thread) on a tiny random model, every operation,
every check (no 5xx, documented statuses, content types and response schemas,
invalid bodies refused, valid ones accepted: 2xx, but for the few rules JSON
Schema cannot state, listed in schemathesis_hooks.py; 405s with Allow).
Settings and hooks: schemathesis.toml and schemathesis_hooks.py beside this
file (the longer run in docs/security.md uses the same). And the document
against the server directly: bodies at the edges of its rules, each accepted
exactly when the document admits it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
import uvicorn
from schemathesis.engine import Status, events, from_schema

from pagedllm import LLM
from pagedllm.bench.server_process import free_port
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from tests.conftest import assert_pool_free
from tests.entrypoints import schemathesis_hooks

CONFIG = Path(__file__).with_name("schemathesis.toml")
# The server's limits, kept small so that the bounds the fuzzer draws from stay cheap to run.
ENGINE = dict(num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
              override_generation_config={"max_new_tokens": schemathesis_hooks.LONGEST})


@pytest.fixture(scope="module")
def live_server(tiny_llama) -> Iterator[tuple[str, LLM]]:
    """(base URL, LLM) of a server listening on 127.0.0.1; when it stops, its pool must be all free."""
    llm = LLM(tiny_llama, **ENGINE)
    port = free_port()
    app = build_app(ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name="tiny"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield base, llm
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}  # no fuzzed request killed the engine loop
    server.should_exit = True
    thread.join(timeout=60)
    assert_pool_free(llm)


def run_schemathesis(base: str, **untuned: Any) -> tuple[int, int, list[str]]:
    """Run schemathesis's engine (the phases and checks of `schemathesis run`) against
    ``base`` (with ``untuned`` settings: see ``load_schema``); return the test cases, the
    checks run and the problems found."""
    schema = load_schema(base, **untuned)
    cases = checks = 0
    problems: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            cases += len(event.recorder.cases)
            for case_id, nodes in event.recorder.checks.items():
                checks += len(nodes)
                problems += [f"{event.recorder.label}: {node.name}: {node.failure_info.failure.title} "
                             f"({event.recorder.cases[case_id].value.body!r})"
                             for node in nodes if node.failure_info is not None]
            if event.status == Status.ERROR:
                problems.append(f"{event.recorder.label}: error")
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            problems.append(repr(event))
    return cases, checks, problems


def load_schema(base: str, seed: int | None = None, phases: list[str] | None = None,
                max_examples: int | None = None):
    """The document under schemathesis.toml's settings, or with another ``seed``,
    ``phases`` and ``max_examples`` (and no example database, so a run is its seed's)."""
    config = schemathesis.Config.from_path(CONFIG)
    if seed is not None:
        config.update(seed=seed, max_failures=None)
    if phases is not None:
        config.projects.default.phases.update(phases=phases)
    if max_examples is not None:
        config.projects.default.generation.update(max_examples=max_examples, database="none")
    return schemathesis.openapi.from_url(f"{base}/openapi.json", config=config)


def test_the_server_passes_every_schemathesis_check(live_server):
    base, _ = live_server
    cases, checks, problems = run_schemathesis(base)
    assert not problems, "\n".join(problems[:20])
    assert cases > 200 and checks > cases  # every operation was exercised, each case by several checks


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7, 2026])
def test_the_server_passes_schemathesis_under_settings_it_was_not_tuned_to(live_server, seed):
    """Other seeds, every phase (the examples and the stateful links too) and more examples
    than schemathesis.toml's: the document and the server must agree there as well."""
    base, _ = live_server
    cases, checks, problems = run_schemathesis(base, seed=seed, phases=["examples", "coverage", "fuzzing", "stateful"],
                                               max_examples=15)
    assert not problems, "\n".join(problems[:20])
    assert cases > 300 and checks > cases


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{}]}]}, "messages.0.user.content.str"),
    ("/tokenize", {"messages": [{"role": "tool"}]}, "messages.0.tool.tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c"}], "max_completion_tokens": False},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "priority": 0.5}, "priority"),  # a whole number only (0.0 is one)
    ("/v1/completions", {"prompt": "hi", "min_tokens": 197.5}, "min_tokens"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": True}, "max_tokens"),  # not 1
    ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 5}, "n"),  # over --max-num-seqs
    ("/v1/completions", {"prompt": "hi", "max_tokens": 257}, "max_tokens"),  # over --max-model-len
    ("/v1/completions", {"prompt": [49152]}, "prompt"),  # outside the vocabulary
    # What schemathesis found the document admitted and the server refused, now in the document
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"007": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [" \x1c"]}, "bad_words"),  # blank to str.strip()
    ("/v1/completions", {"prompt": "hi", "seed": 2**63 - 1}, "seed"),  # reads as 2^63 in a double
    ("/v1/completions", {"prompt": "hi", "priority": 2**63}, "priority"),  # past the core's 64-bit wire
    ("/v1/completions", {"prompt": "hi", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {"prompt": "hi", "structural_tag": {}}, "structural_tag"),  # unimplemented
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "echo": 0}, "echo"),  # not false
    ("/v1/completions", {"prompt": "hi", "suffix": ""}, "suffix"),  # no fill-in-the-middle tokens
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tools"),  # the template renders no tools
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "chat_template_kwargs": {"x": 1}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 1}, "top_logprobs"),
    ("/tokenize", {}, "prompt"),
])
def test_bad_bodies_are_a_400_naming_the_field(live_server, path, body, param):
    base, _ = live_server
    response = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}),  # a message without content
    ("/tokenize", {"messages": [{"role": "system"}, {"role": "user"}]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": 5e-324}),  # 0 in float32
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1024, "logit_bias": {"49151": -5}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "length_penalty": 1, "echo": False,
                         "structural_tag": None, "bad_words": ["x "]}),
    ("/detokenize", {"tokens": [0, 49151]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 10**30}),  # no top-k, as any past the vocabulary
])
def test_edge_bodies_the_document_admits_are_accepted(live_server, path, body):
    base, _ = live_server
    response = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text


# Integer fields sent as whole-number floats (JSON Schema counts 2.0 as an integer, vLLM parses it so).
WHOLE_FLOATS = [
    ("/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 3.0, "n": 1.0, "best_of": 1.0, "seed": 197.0,
                         "min_tokens": 1.0, "priority": 0.0, "top_k": 5.0, "stop_token_ids": [3.0], "logprobs": 1.0,
                         "truncate_prompt_tokens": -1.0, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3.0,
                              "logprobs": True, "top_logprobs": 2.0, "allowed_token_ids": [7.0, 8.0],
                              "temperature": 0}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3.0, "temperature": 0}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3.0,
                      "temperature": 0}),
    ("/detokenize", {"tokens": [0.0, 49151.0]}),
]


def _without_ids(value):
    """An answer less what differs between two requests (ids, times)."""
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_ids(item) for key, item in value.items() if key not in ("id", "created", "created_at", "completed_at")}
    return value


def _as_integers(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_as_integers(item) for item in value]
    return {key: _as_integers(item) for key, item in value.items()} if isinstance(value, dict) else value


@pytest.mark.parametrize(("path", "body"), WHOLE_FLOATS)
def test_whole_number_floats_are_taken_as_the_integers(live_server, path, body):
    base, _ = live_server
    document = httpx.get(f"{base}/openapi.json").json()
    assert _document_admits(document, path, body)
    as_floats = httpx.post(f"{base}{path}", json=body, timeout=60)
    as_integers = httpx.post(f"{base}{path}", json=_as_integers(body), timeout=60)
    assert as_floats.status_code == 200, as_floats.text
    assert _without_ids(as_floats.json()) == _without_ids(as_integers.json())  # the same answer (greedy)


def _document_admits(document: dict, path: str, body: dict) -> bool:
    reference = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    validator = jsonschema.Draft202012Validator({**document, "$ref": reference})
    return validator.is_valid(body)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body"), [
    # the rules between fields, stated in the document (protocol's json_schema_extra), on both sides of each
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2, "logprobs": False}),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2, "logprobs": True}),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": None}),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "none", "tools": []}),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": None}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "text"}}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": False}}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": True}}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "json_object": False}}),
    ("/tokenize", {"prompt": None, "messages": None}),
    ("/tokenize", {"prompt": "hi", "chat_template": "x", "tools": [{"function": {"name": "f"}}]}),  # no messages
    ("/tokenize", {"messages": HI, "chat_template": "x"}),
    ("/tokenize", {"messages": HI, "continue_final_message": True}),
    ("/tokenize", {"messages": [*HI, {"role": "assistant", "content": "a"}], "continue_final_message": True,
                   "add_generation_prompt": False}),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": [*HI, {"role": "assistant", "content": "a"}],
                              "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": [*HI, {"role": "assistant", "content": "a"}],
                              "continue_final_message": True, "add_generation_prompt": False}),
    ("/v1/chat/completions", {"messages": HI, "continue_final_message": False, "add_generation_prompt": True}),
    ("/v1/completions", {"prompt": "hi", "model": "tiny"}),
    ("/v1/completions", {"prompt": "hi", "model": "other"}),
])
def test_the_server_accepts_a_body_exactly_when_the_document_admits_it(live_server, path, body):
    base, _ = live_server
    document = httpx.get(f"{base}/openapi.json").json()
    response = httpx.post(f"{base}{path}", json={"max_tokens": 2, **body} if "completions" in path else body,
                          timeout=60)
    assert response.status_code in (200, 400, 404), response.text
    assert _document_admits(document, path, body) == (response.status_code == 200), response.text


def test_a_chat_without_max_tokens_stops_at_the_servers_default(live_server):
    base, _ = live_server
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    usage = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["completion_tokens"] == schemathesis_hooks.LONGEST  # --override-generation-config max_new_tokens


def test_the_openapi_document_tells_what_the_server_does(live_server):
    base, llm = live_server
    document = httpx.get(f"{base}/openapi.json").json()
    operations = [op for path in document["paths"].values() for op in path.values()]
    assert not [op for op in operations if "422" in op["responses"]]
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["200"]["content"]["text/event-stream"]["schema"]["properties"]["data"]["type"] == "string"
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(document["paths"]["/dashboard"]["get"]["responses"]["200"]["content"]) == {"text/html"}
    schemas = document["components"]["schemas"]
    fields = schemas["CompletionRequest"]["properties"]
    assert fields["n"]["maximum"] == ENGINE["max_num_seqs"] and fields["n"]["minimum"] == 1
    assert fields["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": ENGINE["max_model_len"]}
    assert fields["priority"]["maximum"] == fields["priority"]["minimum"] == 0  # fcfs: no priorities
    # Integer bounds as exact JSON integers (FastAPI's models make them floats: 2^63 - 1 would read as 2^63)
    assert fields["seed"]["anyOf"][0]["maximum"] == 2**63 - 1024 and type(fields["min_tokens"]["minimum"]) is int
    # Every token id field bounded by the vocabulary (logit_bias's keys by a pattern)
    vocab = llm.llm_engine.vocab_size
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    assert fields["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1
    bias_keys = fields["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"]
    assert jsonschema.Draft202012Validator({"pattern": bias_keys}).is_valid(str(vocab - 1))
    assert not jsonschema.Draft202012Validator({"pattern": bias_keys}).is_valid(str(vocab))
    # This server's settings: its one name, its own template (which renders no tools), no FIM tokens
    assert fields["model"]["anyOf"][0]["enum"] == ["tiny"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    assert chat_fields["chat_template"]["type"] == "null" and chat_fields["tools"]["anyOf"][0]["maxItems"] == 0
    assert fields["suffix"]["type"] == "null"
    # Unimplemented fields take only their harmless values; the work cap is stated
    assert fields["use_beam_search"]["anyOf"] == [{"type": "null"}, {"const": False}]
    assert all(schemas[name]["x-max-tokens-per-request"] == 16384
               for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest"))
    health = httpx.get(f"{base}/health")
    assert health.json() == {"status": "ok"} and health.headers["content-type"] == "application/json"
    wrong_method = httpx.post(f"{base}/health")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                              "top_logprobs": 2, "allowed_token_ids": [7]}),  # the others' logprobs: -inf
])
def test_these_answers_pass_every_check(live_server, path, body):
    """Streams (each event against the documented event schema) and a -inf logprob, which
    generated bodies rarely reach."""
    base, _ = live_server
    case = load_schema(base)[path]["POST"].Case(body=body, media_type="application/json")
    assert case.call_and_validate().status_code == 200

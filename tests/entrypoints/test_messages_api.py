"""Anthropic's Messages API (POST /v1/messages) with the official `anthropic` client.

A tiny random-weight Llama served with the shipped Hermes template under an API
key, on a real socket (``uvicorn_thread``), so the client streams as it would
from a remote server; the reasoning tests run the tiny random Qwen3 whose
template opens ``<think>``, under ``--reasoning-parser qwen3``. Every test that
runs the engine ends with the pool all free.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import pytest

from pagedllm import LLM
from pagedllm.bench.server_process import free_port
from pagedllm.bench.soak import metric_value
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.chat_utils import ChatSettings, load_chat_template
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import assert_server_pool_free, uvicorn_thread

MODEL = "tiny"
KEY = "sk-messages-test"
HEADERS = {"x-api-key": KEY}
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           # Bounded values, so even random weights finish a call well within max_tokens.
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # not a keyword of this client version's create(): sent as extra_body


def _serving(model_dir: str, **state_fields):
    """(anthropic client, base URL) of a live server on ``model_dir``; its pool is all free at the end."""
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=1024)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name=MODEL,
                        api_keys={KEY: None}, **state_fields)
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        base = f"http://127.0.0.1:{port}"
        yield anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120), base
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def llama_server(tiny_llama):
    yield from _serving(tiny_llama, chat=ChatSettings(chat_template=load_chat_template("hermes")))


@pytest.fixture
def server(llama_server):
    yield llama_server
    assert_server_pool_free(llama_server[1], HEADERS)


@pytest.fixture(scope="module")
def reasoning_module_server(tiny_reasoning_model):
    yield from _serving(tiny_reasoning_model, reasoning_parser="qwen3")


@pytest.fixture
def reasoning_server(reasoning_module_server):
    yield reasoning_module_server
    assert_server_pool_free(reasoning_module_server[1], HEADERS)


def _raw_events(base: str, body: dict) -> list[tuple[str, dict]]:
    """(event line, data) of each server-sent event of a streamed request."""
    response = httpx.post(f"{base}/v1/messages", json={**body, "stream": True}, headers=HEADERS, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def _chat(base: str, body: dict) -> dict:
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=HEADERS, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_create_answers_a_message(server):
    client, _ = server
    message = client.messages.create(model=MODEL, max_tokens=5, messages=ASK, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
    assert message.usage.cache_creation_input_tokens == 0


def test_greedy_message_equals_chat_completions(server):
    """The same conversation through both front doors: the same prompt, the same greedy text."""
    client, base = server
    system = "You answer briefly."
    message = client.messages.create(model=MODEL, max_tokens=12, system=[{"type": "text", "text": system}],
                                     messages=ASK, extra_body=GREEDY)
    chat = _chat(base, {"model": MODEL, "max_tokens": 12, "temperature": 0,
                        "messages": [{"role": "system", "content": system}, *ASK]})
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_stream_builds_the_same_message_in_anthropics_event_order(server):
    client, base = server
    kwargs = dict(model=MODEL, max_tokens=10, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    events = _raw_events(base, {"model": MODEL, "max_tokens": 10, "messages": ASK, "temperature": 0})
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 10


def test_stop_sequences_end_the_message_and_are_reported(server):
    client, base = server
    free = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY).content[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), free
    message = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=[stop],
                                     extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == free[:free.index(stop)]
    events = _raw_events(base, {"model": MODEL, "max_tokens": 16, "messages": ASK, "temperature": 0,
                                "stop_sequences": [stop]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def _check_calls(message, names: set[str]) -> list:
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use"
    for call in calls:
        assert call.id.startswith("toolu_") and call.name in names
        jsonschema.validate(call.input, WEATHER["input_schema"])
    return calls


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_choice_gives_tool_use_blocks_and_a_follow_up_turn_runs(server, tool_choice):
    client, base = server
    kwargs = dict(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                  extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    calls = _check_calls(message, {"get_weather"})
    if tool_choice["type"] == "tool":
        assert len(calls) == 1
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(c.name, c.input) for c in _check_calls(final, {"get_weather"})] == [(c.name, c.input) for c in calls]
    events = _raw_events(base, {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": [WEATHER],
                                "tool_choice": tool_choice, "temperature": 0})
    assert any(data.get("delta", {}).get("type") == "input_json_delta" for _, data in events)
    follow_up = ASK + [{"role": "assistant", "content": message.content},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                     "content": "22 C and sunny"} for call in calls]}]
    answer = client.messages.create(model=MODEL, max_tokens=4, messages=follow_up, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The tool results reach the prompt as chat's tool messages do.
    chat_history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.input)}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c.id, "content": "22 C and sunny"} for c in calls]
    tokenized = httpx.post(f"{base}/tokenize", headers=HEADERS, json={
        "messages": chat_history, "tools": [{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}]}).json()
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == tokenized["count"]


def test_a_repeated_long_prompt_is_read_from_the_prefix_cache(server):
    client, _ = server
    system = " ".join(f"Rule {i}: answer in plain words." for i in range(40))  # several KV blocks
    first = client.messages.create(model=MODEL, max_tokens=2, system=system, messages=ASK, extra_body=GREEDY)
    second = client.messages.create(model=MODEL, max_tokens=2, system=system, messages=ASK, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens > 0
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total > 100
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens


def test_a_final_assistant_turn_is_continued(server):
    client, base = server
    prefill = ASK + [{"role": "assistant", "content": "It is"}]
    message = client.messages.create(model=MODEL, max_tokens=6, messages=prefill, extra_body=GREEDY)
    chat = _chat(base, {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": prefill,
                        "continue_final_message": True, "add_generation_prompt": False})
    assert message.content[0].text == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]: this model takes text only"),
    ({"max_tokens": 2, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "Anthropic's server tools"),
    ({"max_tokens": 2, "messages": ASK, "container": "c"}, 400, "invalid_request_error", "container is not implemented"),
    ({"max_tokens": 2, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "--reasoning-parser"),
    ({"max_tokens": 2, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "needs tools"),
    ({"max_tokens": 2, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "'nope', which is not in tools"),
    ({"max_tokens": 5000, "messages": ASK}, 400, "invalid_request_error", "max_tokens must be <= 1024"),
    ({"max_tokens": 2, "messages": ASK, "model": "claude-sonnet-4-5"}, 404, "not_found_error",
     "'claude-sonnet-4-5' does not exist"),
])
def test_errors_are_anthropic_shaped(server, body, status, kind, says):
    _, base = server
    response = httpx.post(f"{base}/v1/messages", json={"model": MODEL, **body}, headers=HEADERS, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"], error


def test_other_paths_keep_openais_error_shape_and_the_routes_are_documented(server):
    _, base = server
    wrong_method = httpx.get(f"{base}/v1/messages", headers=HEADERS)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, headers=HEADERS)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"  # OpenAI's shape
    ignored = httpx.post(f"{base}/v1/messages", headers=HEADERS, json={
        "model": MODEL, "max_tokens": 1, "messages": ASK, "a_field_from_the_future": 1, "service_tier": "auto",
        "cache_control": {"type": "ephemeral"}, "metadata": {"user_id": "u"}})
    assert ignored.status_code == 200, ignored.text
    document = httpx.get(f"{base}/openapi.json").json()
    route = document["paths"]["/v1/messages"]["post"]["responses"]
    assert route["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/MessageResponse"}
    assert "text/event-stream" in route["200"]["content"]
    assert route["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnthropicErrorResponse"}
    request = document["components"]["schemas"]["MessagesRequest"]
    assert request["properties"]["model"]["enum"] == [MODEL] and "max_tokens" in request["required"]
    assert request["properties"]["max_tokens"]["maximum"] == 1024  # --max-model-len
    assert "/v1/messages/count_tokens" in document["paths"]


def test_x_api_key_or_bearer_under_api_key(serve):
    """`pagedllm serve --api-key`: Anthropic's header or a bearer token; without one a 401 in Anthropic's shape."""
    app, options, _ = serve("--served-model-name", MODEL, "--api-key", KEY)
    port = free_port()
    with uvicorn_thread(app, {**options, "host": "127.0.0.1", "port": port, "log_level": "warning"}):
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.time() < deadline, "the model did not load"
            time.sleep(0.2)
        body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
        missing = httpx.post(f"{base}/v1/messages", json=body)
        assert missing.status_code == 401
        assert missing.json() == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "invalid or missing API key"}}
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**body)
        assert httpx.post(f"{base}/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}).is_success
        versioned = {**HEADERS, "anthropic-version": "2023-06-01"}
        assert httpx.post(f"{base}/v1/messages", json=body, headers=versioned).is_success
        message = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(**body)
        assert message.usage.output_tokens == 2
        assert httpx.post(f"{base}/v1/chat/completions", json={"messages": ASK}).json()["error"]["type"] == \
            "authentication_error"  # OpenAI's shape elsewhere (an x-api-key is accepted there too)
        assert_server_pool_free(base, HEADERS)


THINK = {"type": "enabled", "budget_tokens": 1024}


def test_thinking_comes_as_thinking_blocks_whole_and_streamed(reasoning_server):
    """The template opens <think> and a random model never closes it: all it writes is thinking."""
    client, base = reasoning_server
    kwargs = dict(model=MODEL, max_tokens=8, messages=ASK, thinking=THINK, extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking and message.content[0].signature == ""
    assert message.stop_reason == "max_tokens"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id", "usage"}) == message.model_dump(exclude={"id", "usage"})
    events = _raw_events(base, {"model": MODEL, "max_tokens": 8, "messages": ASK, "thinking": THINK,
                                "temperature": 0})
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [data["delta"] for kind, data in events if kind == "content_block_delta"]
    assert deltas and all(delta["type"] == "thinking_delta" for delta in deltas)
    assert "".join(delta["thinking"] for delta in deltas) == message.content[0].thinking
    omitted = client.messages.create(**{**kwargs, "thinking": {**THINK, "display": "omitted"}})
    assert omitted.content == [] and omitted.usage.output_tokens == 8


def test_thinking_disabled_turns_the_templates_switch_off(reasoning_server):
    client, _ = reasoning_server
    message = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, thinking={"type": "disabled"},
                                     extra_body=GREEDY)
    assert [block.type for block in message.content] == ["text"]
    # Thinking passed back is not rendered: the prompt is the one without it.
    turn = [{"type": "text", "text": "Sunny."}]
    history = [*ASK, {"role": "assistant", "content": turn}, {"role": "user", "content": "Thanks"}]
    thought = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                                       *turn]}, {"role": "user", "content": "Thanks"}]
    assert client.messages.count_tokens(model=MODEL, messages=history).input_tokens == \
        client.messages.count_tokens(model=MODEL, messages=thought).input_tokens


def _aborted(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    try:
        return metric_value(text, "pagedllm:request_success_total", finished_reason="abort")
    except ValueError:  # no request aborted yet
        return 0.0


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    _, base = server
    before = _aborted(base)
    body = {"model": MODEL, "max_tokens": 1000, "messages": ASK, "stream": True, "temperature": 0,
            "stop_sequences": ["never written"]}
    with httpx.stream("POST", f"{base}/v1/messages", json=body, headers=HEADERS, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
    deadline = time.time() + 60
    while _aborted(base) == before:
        assert time.time() < deadline, "the request was not aborted"
        time.sleep(0.1)

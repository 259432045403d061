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

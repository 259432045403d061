"""The Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) with the
official `openai` client and the OpenAI Agents SDK, on tiny random models served
live (uvicorn in a thread): Hermes tools forced by tool_choice, JSON schema by
text.format, greedy equality with /v1/chat/completions, the store and its
tenants, the reasoning items of a Qwen3-style thinking model. Every answer and
every streamed event is validated against the openai package's own types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from pagedllm import LLM
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.chat_utils import ChatSettings, load_chat_template
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from tests.entrypoints.live_server import assert_server_pool_free, uvicorn_thread
from tests.entrypoints.test_serve_ops import ready

MODEL = "tiny"
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city", "strict": True,
           # Bounded values, so even random weights finish a call well within max_output_tokens.
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
PLAIN_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                "response.output_item.done"]


def live(llm: LLM, **state) -> Iterator[str]:
    """The base URL of ``llm`` served live; its pool must be all free after every test."""
    app = build_app(ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name=MODEL, **state))
    with uvicorn_thread(app, {"host": "127.0.0.1", "port": 0, "log_level": "warning"}) as server:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def base(tiny_llama) -> Iterator[str]:
    yield from live(LLM(tiny_llama, num_kv_blocks=256, max_model_len=2048),
                    chat=ChatSettings(chat_template=load_chat_template("hermes")))


@pytest.fixture(autouse=True)
def pool_free_after(request):
    yield
    for name in ("base", "thinking_base"):
        if name in request.fixturenames:
            assert_server_pool_free(request.getfixturevalue(name))


def client_of(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def create(base: str, **body) -> Response:
    """A whole response, its JSON validated against the openai package's Response."""
    answer = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert answer.status_code == 200, answer.text
    return Response.model_validate(answer.json())


def streamed(base: str, **body) -> list[dict]:
    """The events of a streamed response, each checked: its SSE event name, its type in
    the openai package's events, its sequence number."""
    with httpx.stream("POST", f"{base}/v1/responses", timeout=120,
                      json={"model": MODEL, "temperature": 0, **body, "stream": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        event = json.loads(fields["data"])
        assert fields["event"] == event["type"] and event["sequence_number"] == len(events)
        EVENTS.validate_python(event)
        events.append(event)
    return events


def kinds(events: list[dict]) -> list[str]:
    """The event types, each run of deltas as one."""
    collapsed: list[str] = []
    for event in events:
        if not (event["type"].endswith(".delta") and collapsed and collapsed[-1] == event["type"]):
            collapsed.append(event["type"])
    return collapsed


def test_plain_streamed_and_the_openai_client(base):
    whole = create(base, input="Hello there", max_output_tokens=6)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 6 and whole.usage.total_tokens == whole.usage.input_tokens + 6
    events = streamed(base, input="Hello there", max_output_tokens=6)
    assert kinds(events) == PLAIN_EVENTS + ["response.incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == whole.output_text
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == whole.output_text and final.usage.output_tokens == 6
    client = client_of(base)
    assert client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6,
                                   temperature=0).output_text == whole.output_text
    types = [event.type for event in client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6,
                                                             temperature=0, stream=True)]
    assert types == [event["type"] for event in events]


def test_the_text_is_chat_completions_text_for_the_same_conversation(base):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped, as templates drop earlier thinking
             {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                          {"type": "input_text", "text": "Paris?"}]}]
    response = create(base, instructions="Be terse.", input=items, max_output_tokens=12)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]
    chat = client_of(base).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)


def test_forced_function_call_then_its_output_continues_the_conversation(base):
    first = create(base, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=200)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = streamed(base, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                      max_output_tokens=200)
    assert kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.output_item.done", "response.completed"]
    assert events[-3]["arguments"] == call.arguments and events[-2]["item"]["arguments"] == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}
    follow = create(base, previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=4)
    # The same conversation sent whole, without the store, is the same prompt and answer.
    whole = create(base, input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result],
                   tools=[WEATHER], max_output_tokens=4, store=False)
    assert (follow.usage.input_tokens, follow.output_text) == (whole.usage.input_tokens, whole.output_text)
    chat_messages = [{"role": "user", "content": ASK},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                         "name": call.name, "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": "22 C and sunny"}]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    tokenized = httpx.post(f"{base}/tokenize", json={"messages": chat_messages, "tools": [chat_tool]}).json()
    assert follow.usage.input_tokens == tokenized["count"] > first.usage.input_tokens


def test_a_named_tool_choice_streams_the_same_call(base):
    body = dict(input="What time is it in Tokyo?", tools=[WEATHER, TIME],
                tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=100)
    whole = create(base, **body)
    assert [(item.type, item.name) for item in whole.output] == [("function_call", "get_time")]
    done = [e for e in streamed(base, **body) if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == [whole.output[0].arguments]


def test_a_json_schema_text_format_is_followed(base):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    response = create(base, input="A forecast, as JSON", max_output_tokens=100,
                      text={"format": {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema


def test_previous_response_id_continues_without_the_earlier_instructions(base):
    first = create(base, instructions="Be brief.", input="My name is Ada.", max_output_tokens=6)
    second = create(base, previous_response_id=first.id, input="What is my name?", max_output_tokens=6)
    assert second.previous_response_id == first.id and second.instructions is None
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    tokenized = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()
    assert second.usage.input_tokens == tokenized["count"] > first.usage.input_tokens


def test_get_and_delete_a_stored_response(base):
    client = client_of(base)
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, metadata={"run": "7"})
    assert response.store is True and response.metadata == {"run": "7"}
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    deleted = httpx.delete(f"{base}/v1/responses/{response.id}")
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    for call in (lambda: client.responses.retrieve(response.id), lambda: client.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="more", previous_response_id=response.id, max_output_tokens=2)
    error = missing.value.response.json()["error"]
    assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0", "built-in tool 'web_search' is not supported"),
    ({"tools": [WEATHER, {"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.1", "built-in"),
    ({"background": True}, "background", "not implemented"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not implemented"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "not implemented"),
    ({"truncation": "auto"}, "truncation", "not implemented"),
    ({"conversation": "conv_1"}, "conversation", "not implemented"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "medium"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", ""),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input", ""),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "an item other than reasoning"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens must be <= 2048"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "a"}}}},
     "text.format", ""),
])
def test_what_is_not_implemented_is_a_400_naming_it(base, body, param, message):
    answer = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "input": "Hi", **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error


def test_tenants_never_see_each_others_responses_and_the_store_is_bounded(serve, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "a", "key-b": "b"}))
    app, _, _ = serve("--api-keys-file", str(keys), "--served-model-name", MODEL,
                      "--responses-store-max-entries", "2")
    a, b = ({"Authorization": f"Bearer key-{name}"} for name in "ab")
    with ready(app) as http:
        ids = [http.post("/v1/responses", json={"input": f"turn {i}", "max_output_tokens": 2}, headers=a).json()["id"]
               for i in range(3)]
        assert http.get(f"/v1/responses/{ids[0]}", headers=a).status_code == 404  # the least recently used went
        assert http.get(f"/v1/responses/{ids[2]}", headers=a).json()["id"] == ids[2]
        for answer in (http.get(f"/v1/responses/{ids[2]}", headers=b), http.delete(f"/v1/responses/{ids[2]}", headers=b),
                       http.post("/v1/responses", json={"input": "x", "previous_response_id": ids[2]}, headers=b)):
            assert answer.status_code == 404, answer.text  # as if it did not exist
        assert http.get(f"/v1/responses/{ids[2]}").status_code == 401
        assert http.get(f"/v1/responses/{ids[2]}", headers=a).status_code == 200  # b's attempts changed nothing
        follow = http.post("/v1/responses", json={"input": "x", "previous_response_id": ids[2], "max_output_tokens": 2},
                           headers=a)
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == ids[2]


def test_a_response_the_store_cannot_hold_says_store_false(serve):
    app, _, _ = serve("--served-model-name", MODEL, "--responses-store-max-bytes", "100")
    with ready(app) as http:
        answer = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()
        assert answer["store"] is False and http.get(f"/v1/responses/{answer['id']}").status_code == 404


def test_the_openapi_document_tells_what_the_routes_do(base):
    document = httpx.get(f"{base}/openapi.json").json()
    create_statuses = document["paths"]["/v1/responses"]["post"]["responses"]
    assert {"200", "400", "401", "404", "503"} <= set(create_statuses)
    assert set(create_statuses["200"]["content"]) == {"application/json", "text/event-stream"}
    stored = document["paths"]["/v1/responses/{response_id}"]
    assert set(stored) == {"get", "delete"} and all({"401", "404", "503"} <= set(op["responses"])
                                                    for op in stored.values())
    fields = document["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert fields["model"]["anyOf"][0]["enum"] == [MODEL] and fields["max_output_tokens"]["anyOf"][0]["maximum"] == 2048
    wrong_method = httpx.put(f"{base}/v1/responses/resp_1")
    assert wrong_method.status_code == 405 and set(wrong_method.headers["allow"].split(", ")) == {"GET", "DELETE"}


def test_the_agents_sdk_runs_a_tool_loop(base):
    import agents

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "22 C and sunny"

    class Forecast(BaseModel):
        sky: Literal["sunny", "rainy"]

    async def run(streamed_run: bool) -> object:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        # The SDK resets tool_choice after a tool call, so the second turn answers with the output type.
        settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                        max_tokens=200)
        agent = agents.Agent(name="forecaster", instructions="Look the weather up, then answer.", tools=[get_weather],
                             output_type=Forecast, model_settings=settings,
                             model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client))
        try:
            if not streamed_run:
                return (await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)).final_output
            result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
            async for _ in result.stream_events():
                pass
            return result.final_output
        finally:
            await client.close()

    for streamed_run in (False, True):
        before = len(calls)
        assert isinstance(asyncio.run(run(streamed_run)), Forecast)
        assert len(calls) > before  # the tool ran


@pytest.fixture(scope="module")
def thinking_base(tiny_reasoning_model) -> Iterator[str]:
    yield from live(LLM(tiny_reasoning_model, num_kv_blocks=128, max_model_len=1024), reasoning_parser="qwen3")


def test_thinking_comes_back_as_a_reasoning_item(thinking_base):
    """A random model never closes the thinking its template opened: all it writes is reasoning."""
    response = create(thinking_base, input="Think it over", max_output_tokens=8)
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text == ""
    reasoning = response.output[0]
    chat = client_of(thinking_base).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think it over"}], max_tokens=8, temperature=0)
    assert reasoning.content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 8
    events = streamed(thinking_base, input="Think it over", max_output_tokens=8)
    assert kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", *PLAIN_EVENTS[2:4], *PLAIN_EVENTS[5:], "response.incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning.content[0].text
    # Passed back, the reasoning item is dropped from the prompt, as the template drops earlier thinking.
    follow = create(thinking_base, input=[{"role": "user", "content": "Think it over"},
                                          *(item.model_dump(exclude_none=True) for item in response.output),
                                          {"role": "user", "content": "And?"}], max_output_tokens=2)
    tokenized = httpx.post(f"{thinking_base}/tokenize", json={"messages": [
        {"role": "user", "content": "Think it over"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "And?"}]}).json()
    assert follow.usage.input_tokens == tokenized["count"]

"""Tools and chat templates over HTTP, with the official `openai` client.

A tiny random-weight Llama served in-process (FastAPI's TestClient is an httpx
client, so the openai client talks to the app directly) with the shipped Hermes
template; the end-to-end round trip on the real SmolLM2 is at the bottom (slow).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM
from pagedllm.bench.server_process import running_server
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.chat_utils import ChatRenderOptions, ChatSettings, load_chat_template, render_chat
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from tests.conftest import assert_pool_free

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    # Bounded values, so even random weights finish a call well within max_tokens.
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
]


@pytest.fixture(scope="module")
def served(tiny_llama):
    """(openai client, server state, the LLM whose engine it serves, the plain HTTP client)."""
    llm = LLM(tiny_llama, num_kv_blocks=128, max_model_len=2048)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name=MODEL,
                        chat=ChatSettings(chat_template=load_chat_template("hermes")))
    with TestClient(build_app(state)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        yield client, state, llm, http


def test_tool_history_is_rendered_with_the_servers_template(served):
    client, state, llm, http = served
    response = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER, TIME], max_tokens=4,
                                              temperature=0)
    expected = render_chat(llm.get_tokenizer(), HISTORY,
                           ChatRenderOptions(tools=[WEATHER, TIME], chat_template=state.chat.chat_template))
    assert "<tool_response>\n22 C and sunny" in expected["prompt"]
    assert response.usage.prompt_tokens == len(expected["prompt_token_ids"])
    tokenized = http.post("/tokenize", json={"messages": HISTORY, "tools": [WEATHER, TIME]}).json()
    assert tokenized["tokens"] == expected["prompt_token_ids"]  # /tokenize renders exactly as the chat route
    assert response.choices[0].finish_reason == "length"  # random weights: no call, all content
    assert response.choices[0].message.tool_calls is None and response.choices[0].message.content is not None
    assert_pool_free(llm)


def test_continue_final_message_and_chat_template_kwargs(served):
    client, state, llm, _ = served
    partial = ASK + [{"role": "assistant", "content": "It is"}]
    response = client.chat.completions.create(
        model=MODEL, messages=partial, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    expected = render_chat(llm.get_tokenizer(), partial, ChatRenderOptions(
        continue_final_message=True, add_generation_prompt=False, chat_template=state.chat.chat_template))
    assert expected["prompt"].endswith("<|im_start|>assistant\nIt is")
    assert response.usage.prompt_tokens == len(expected["prompt_token_ids"])
    state.chat = ChatSettings(state.chat.chat_template, trust_request_chat_template=True)
    try:
        template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!{% endif %}"
        response = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                                  extra_body={"chat_template": template,
                                                              "chat_template_kwargs": {"shout": True}})
        expected_ids = llm.get_tokenizer().encode(ASK[0]["content"] + "!!", add_special_tokens=False)
        assert response.usage.prompt_tokens == len(expected_ids)
    finally:
        state.chat = ChatSettings(state.chat.chat_template)
    assert_pool_free(llm)


@pytest.mark.parametrize("body, param, message", [
    ({"messages": ASK, "tools": [WEATHER], "chat_template": "{{ messages[0].content }}"}, "chat_template",
     "--trust-request-chat-template"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "tool_choice", "'get_date', which is not in tools"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": ASK, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "last message to be the assistant's"),
    ({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
     "never reads enable_thinking"),
    # the request schema types each role's message, so the 400 names the missing field itself
    ({"messages": HISTORY[:1] + [{"role": "tool", "content": "22 C"}]}, "messages.1.tool.tool_call_id",
     "Field required"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name",
     "pattern"),
])
def test_bad_tool_requests_are_400s_naming_the_field(served, body, param, message):
    client, _, llm, _ = served
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, max_tokens=2, **{k: v for k, v in body.items()
                                                                    if k in ("messages", "tools", "tool_choice")},
                                       extra_body={k: v for k, v in body.items()
                                                   if k not in ("messages", "tools", "tool_choice")})
    error = bad.value.response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert_pool_free(llm)


def test_tools_with_a_template_that_ignores_them_is_a_400(served):
    client, state, llm, _ = served
    state.chat = ChatSettings(None)  # the model's own template (SmolLM2's) never renders tools
    try:
        with pytest.raises(openai.BadRequestError, match="never renders tools.*--chat-template hermes"):
            client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=2)
    finally:
        state.chat = ChatSettings(load_chat_template("hermes"))
    assert_pool_free(llm)


def reassemble(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, calls by index and the finish reason, rebuilt from stream chunks as a client does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_gives_valid_arguments_even_from_random_weights(served, tool_choice):
    client, _, llm, _ = served
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200,
                  temperature=0)
    message = client.chat.completions.create(**kwargs).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content is None
    calls = message.message.tool_calls
    assert calls and all(call.id.startswith("call_") for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_weather"]
    content, streamed, finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (call.function.name, call.function.arguments) for call in calls]
    assert_pool_free(llm)


@pytest.mark.slow
def test_smollm2_tool_round_trip_with_the_hermes_template():
    """The real model with --chat-template hermes: a named call, its result sent
    back as a tool message, then a plain answer; the streamed call is the same."""
    with running_server(["--num-kv-blocks", "256", "--chat-template", "hermes"], start_timeout_s=180) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        model = "SmolLM2-135M-Instruct"
        named = {"type": "function", "function": {"name": "get_weather"}}
        kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=60, temperature=0)
        first = client.chat.completions.create(**kwargs).choices[0]
        assert first.finish_reason == "tool_calls"
        call = first.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS["get_weather"])
        _, streamed, _ = reassemble(client.chat.completions.create(**kwargs, stream=True))
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [("get_weather", call.function.arguments)]
        messages = ASK + [first.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
        answer = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=40,
                                                temperature=0).choices[0]
        assert answer.message.content and answer.finish_reason in ("stop", "length", "tool_calls")
        assert client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=40,
                                              temperature=0, tool_choice="none").choices[0].message.tool_calls is None

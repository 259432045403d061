"""The parts of the Messages API that need no engine: the request's translation to
chat (``to_chat_request``), the event stream built from chat's typed events, and the
Anthropic error shape."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.chat.events import (ChatEvent, ChatResult, ChoiceDelta, ChoiceResult, EngineFailure,
                                                     MessageDelta, ToolCall)
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallDelta
from pagedllm.entrypoints.openai.messages.output import MessageStream, message_events, message_of
from pagedllm.entrypoints.openai.messages.to_chat import to_chat_request
from pagedllm.entrypoints.openai.messages.protocol import MessagesCountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.messages.serving import anthropic_error

TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "They want weather.", "signature": "sig"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "22 C"}]},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
        {"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
]


def _request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 7, "messages": CONVERSATION, **fields})


def test_a_conversation_becomes_chat_messages():
    chat = to_chat_request(_request(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                                    tools=[TOOL], stop_sequences=["\n\n"], metadata={"user_id": "u1"}, top_k=5))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [  # the thinking is not rendered
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tools[0].model_dump(exclude_none=True) == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": TOOL["input_schema"]}}
    assert (chat.max_tokens, chat.stop, chat.user, chat.top_k, chat.stream) == (7, ["\n\n"], "u1", 5, False)
    assert chat.add_generation_prompt and not chat.continue_final_message
    assert chat.chat_template_kwargs is None and chat.tool_choice is None


@pytest.mark.parametrize("choice, expected, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice_maps_to_chats(choice, expected, parallel):
    chat = to_chat_request(_request(tools=[TOOL], tool_choice=choice))
    got = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.model_dump()
    assert got == expected and chat.parallel_tool_calls is parallel


def test_thinking_prefill_streaming_and_output_format():
    thinking = {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}
    assert to_chat_request(_request(thinking=thinking), thinking_switch=True).chat_template_kwargs == {
        "enable_thinking": True}
    assert to_chat_request(_request(thinking=thinking)).chat_template_kwargs is None  # no switch in the template
    assert to_chat_request(_request(thinking=thinking)).include_reasoning is False
    assert to_chat_request(_request(thinking={"type": "disabled"}), thinking_switch=True).chat_template_kwargs == {
        "enable_thinking": False}
    prefill = to_chat_request(_request(messages=[*CONVERSATION, {"role": "assistant", "content": "It is"}]))
    assert prefill.continue_final_message and not prefill.add_generation_prompt
    streamed = to_chat_request(_request(stream=True))
    assert streamed.stream and streamed.stream_options.include_usage
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formatted = to_chat_request(_request(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert formatted.response_format.json_schema.schema_ == schema
    counted = to_chat_request(MessagesCountTokensRequest.model_validate({"model": "m", "messages": CONVERSATION}))
    assert counted.max_tokens is None


@pytest.mark.parametrize("fields, message", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}]}, "content[0].content[0]: document blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "Anthropic's server tools"),
    ({"container": "c"}, "container is not implemented"),
    ({"speed": "fast"}, "speed is not implemented"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "greater than or equal to 1024"),
    ({"messages": [{"role": "system", "content": "x"}]}, "does not match any of the expected tags"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "does not match any of the expected tags"),
    ({"max_tokens": 1.5}, "valid integer"),
    ({"output_config": {"effort": "high"}}, "output_config.effort is not implemented"),
])
def test_what_the_server_cannot_run_is_refused_by_the_request_model(fields, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("[", r"\[").replace(".", r"\.")):
        _request(**fields)


def test_unknown_and_harmless_fields_are_accepted():
    request = _request(service_tier="auto", speed="standard", cache_control={"type": "ephemeral"}, something_new=1)
    assert to_chat_request(request).max_tokens == 7


def _step(first: bool = False, **message) -> ChoiceDelta:
    return ChoiceDelta(0, first, MessageDelta(**message), None, None)


CHUNKS = [
    _step(True, reasoning="Hm"),
    _step(reasoning="m.", content="Sure."),
    _step(tool_calls=(ToolCallDelta(0, "", "call_a", "f"),)),
    _step(tool_calls=(ToolCallDelta(0, '{"x": '),)),
    _step(tool_calls=(ToolCallDelta(0, "1}"), ToolCallDelta(1, "{}", "call_b", "g")), finish_reason="tool_calls"),
    Usage(prompt_tokens=10, completion_tokens=6, cached_tokens=4),
]


async def _events(chunks: list[ChatEvent]) -> tuple[list[tuple[str, dict]], bool]:
    closed = False

    async def source():
        nonlocal closed
        try:
            for chunk in chunks:
                yield chunk
        finally:
            closed = True

    events = []
    async for text in message_events(source(), MessageStream("m", "msg_1", 10)):
        kind, data = (line.split(": ", 1)[1] for line in text.strip().split("\n"))
        events.append((kind, json.loads(data)))
    return events, closed


def test_chunks_become_anthropics_events():
    events, closed = asyncio.run(_events(CHUNKS))
    assert closed
    assert [(kind, data.get("index")) for kind, data in events] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_delta", 2), ("content_block_stop", 2), ("content_block_start", 3),
        ("content_block_delta", 3), ("content_block_stop", 3), ("message_delta", None), ("message_stop", None)]
    assert events[5][1]["content_block"] == {"type": "text", "text": ""}
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}
    assert "".join(d["delta"]["partial_json"] for k, d in events if d.get("index") == 2 and k.endswith("delta")) \
        == '{"x": 1}'
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 6, "output_tokens": 6, "cache_read_input_tokens": 4,
                                       "cache_creation_input_tokens": 0}}


def test_an_engine_death_mid_stream_ends_it_with_an_error_event():
    dead = EngineFailure("the engine loop died")
    events, closed = asyncio.run(_events([CHUNKS[0], dead]))
    assert closed and [kind for kind, _ in events][-1] == "error"
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the engine loop died"}}


def test_a_whole_completion_becomes_a_message():
    choice = ChoiceResult(0, "Hi", (ToolCall("call_z", "f", '{"x": [1'),), "", True, "length", None, None)
    completion = ChatResult([choice], Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0))
    message = message_of(completion, "m", "msg_1")
    # no empty thinking block; a call cut by max_tokens keeps its place with an empty input
    assert message["content"] == [{"type": "text", "text": "Hi"},
                                  {"type": "tool_use", "id": "toolu_z", "name": "f", "input": {}}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("max_tokens", None)
    completion = ChatResult([dataclasses.replace(choice, finish_reason="stop", stop_reason="\n\n")], completion.usage)
    assert message_of(completion, "m", "msg_1")["stop_sequence"] == "\n\n"


@pytest.mark.parametrize("status, code, kind", [
    (400, None, "invalid_request_error"), (401, "invalid_api_key", "authentication_error"),
    (404, "model_not_found", "not_found_error"), (503, "model_loading", "overloaded_error"),
    (503, "engine_dead", "api_error"), (500, None, "api_error"),
])
def test_openai_errors_are_reshaped(status, code, kind):
    body = json.dumps({"error": {"message": "bad", "type": "x", "param": "max_tokens", "code": code}}).encode()
    assert json.loads(anthropic_error(status, body)) == {"type": "error", "error": {
        "type": kind, "message": "max_tokens: bad"}}
    assert json.loads(anthropic_error(500, b"Internal Server Error"))["error"]["message"] == "Internal Server Error"

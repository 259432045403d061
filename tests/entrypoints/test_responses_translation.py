"""The Responses API's two translations, without an engine: a request into the chat
request it runs as (``to_chat_request``), and chat's typed events into the Response and its
events (``ResponseAssembler``), each event checked against the openai package's types."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from pagedllm.entrypoints.openai.chat.events import ChoiceDelta, MessageDelta
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.responses.protocol import ResponsesRequest
from pagedllm.entrypoints.openai.responses.input import output_messages, to_chat_request
from pagedllm.entrypoints.openai.responses.output import ResponseAssembler, echo_fields
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallDelta

EVENTS = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
SCHEMA_FORMAT = {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}}


def chat_of(body: dict, previous: list[dict] | None = None) -> dict:
    return to_chat_request(ResponsesRequest.model_validate(body), previous or []).model_dump(exclude_unset=True,
                                                                                          by_alias=True)


def test_items_become_the_chat_messages_a_client_would_have_sent():
    previous = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    chat = chat_of({"instructions": "Be brief.", "input": [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]}, previous)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]
    assert [m for m in chat["messages"]] == [
        {"role": "system", "content": "Be brief."}, *previous,
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "developer", "content": "ab"}]
    assert previous == [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]


def test_an_earlier_calls_arguments_that_are_not_json_are_rendered_as_a_string():
    """A call cut by max_output_tokens is stored so: a follow-up still runs."""
    chat = chat_of({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{\"city\": \"Par"},
                              {"type": "function_call_output", "call_id": "c", "output": "cut"}]})
    assert chat["messages"][0]["tool_calls"][0]["function"]["arguments"] == '"{\\"city\\": \\"Par"'


def test_settings_map_to_chat_fields_and_unset_ones_stay_unset():
    chat = chat_of({"input": "hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stream": True,
                    "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                    "parallel_tool_calls": False})
    assert chat["max_completion_tokens"] == 7 and chat["stream_options"] == {"include_usage": True}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather",
                                                               "parameters": {"type": "object"}}}]
    assert chat["parallel_tool_calls"] is False and (chat["temperature"], chat["top_p"]) == (0.5, 0.9)
    plain = chat_of({"input": "hi", "tool_choice": "auto"})  # OpenAI's "auto" without tools: nothing to choose
    assert set(plain) == {"messages"}


def test_text_format_is_response_format_except_under_a_forced_call():
    assert chat_of({"input": "hi", "text": SCHEMA_FORMAT})["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}
    assert chat_of({"input": "hi", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in chat_of({"input": "hi", "text": {"format": {"type": "text"}}})
    forced = chat_of({"input": "hi", "text": SCHEMA_FORMAT, "tools": [TOOL], "tool_choice": "required"})
    assert "response_format" not in forced and forced["tool_choice"] == "required"


@pytest.mark.parametrize(("body", "location"), [
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, ("tools", 0)),
    ({"input": "hi", "reasoning": {"summary": "auto"}}, ("reasoning", "summary")),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, ("include",)),
    ({"input": []}, ("input",)),
    ({"input": [{"role": "tool", "content": "x"}]}, ("input",)),
])
def test_the_request_model_refuses_what_is_not_implemented(body, location):
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate(body)
    assert refused.value.errors()[0]["loc"][:len(location)] == location


def test_harmless_defaults_of_unimplemented_fields_pass():
    body = ResponsesRequest.model_validate({"input": "hi", "background": False, "include": [], "truncation": "disabled",
                                            "service_tier": "auto", "reasoning": {"effort": None}, "made_up": 1})
    assert body.stored and body.input == "hi"


def assembled(chunks: list[ChoiceDelta | Usage], body: dict | None = None) -> tuple[list[dict], dict]:
    request = ResponsesRequest.model_validate(body or {"input": "hi"})
    assembler = ResponseAssembler(echo_fields(request, "m"), lambda text: len(text.split()))
    events = assembler.start()
    for chunk in chunks:
        events += assembler.feed_event(chunk)
    events += assembler.finish()
    events.append(assembler.final_event())
    for index, event in enumerate(events):
        assert event["sequence_number"] == index
        EVENTS.validate_python(event)
    return events, Response.model_validate(assembler.response()).model_dump()


def chunk(finish: str | None = None, role: str | None = None, **delta) -> ChoiceDelta:
    """A step of chat's stream (``role``: the choice's first)."""
    return ChoiceDelta(0, role is not None, MessageDelta(finish_reason=finish, **delta), None, None)


USAGE = Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=2)


def test_thinking_text_and_calls_become_items_in_order():
    call = ToolCallDelta(0, "", "call_1", "f")
    events, response = assembled([
        chunk(role="assistant", reasoning="think "), chunk(reasoning="more"),
        chunk(content="Hi"), chunk(tool_calls=(call,)), chunk(tool_calls=(ToolCallDelta(0, "{}"),)),
        chunk(content="after", finish="tool_calls"), USAGE])
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call", "message"]
    assert response["output"][0]["content"][0]["text"] == "think more" and response["status"] == "completed"
    assert response["output"][2]["arguments"] == "{}" and response["output"][2]["call_id"] == "call_1"
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert [e["type"] for e in events if e["type"].startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"] * 4
    # What a follow-up continues: the thinking left out, the call on the assistant turn.
    assert output_messages(response["output"]) == [
        {"role": "assistant", "content": "Hi", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "after"}]


def test_an_output_cut_while_thinking_still_has_a_message_and_is_incomplete():
    events, response = assembled([chunk(role="assistant", reasoning="hmm", finish="length")])
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert [item["status"] for item in response["output"]] == ["incomplete", "incomplete"]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"


def test_an_engine_failure_fails_the_response():
    request = ResponsesRequest.model_validate({"input": "hi"})
    assembler = ResponseAssembler(echo_fields(request, "m"), len)
    assembler.start()
    assembler.feed_event(chunk(role="assistant", content="par"))
    [failed] = assembler.fail("the engine died")
    EVENTS.validate_python(failed)
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["output"][0]["status"] == "incomplete"

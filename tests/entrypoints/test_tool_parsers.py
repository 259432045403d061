"""Tool-call parsers: whole outputs, and the same outputs streamed in pieces."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser, NamedToolParser, RequiredToolParser, plan_tool_choice,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def parse_whole(parser, text: str):
    parser.feed(text)
    parser.finish()
    return parser.message()


def parse_streamed(parser, pieces: list[str]):
    """Feed the pieces; rebuild content and calls from the deltas alone, as an OpenAI client does."""
    content, calls = "", {}
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            body = call.to_openai()
            if "id" in body:
                assert body["index"] not in calls and body["function"]["arguments"] == ""
                calls[body["index"]] = {"id": body["id"], "type": "function",
                                        "function": {"name": body["function"]["name"], "arguments": ""}}
            calls[body["index"]]["function"]["arguments"] += body["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], deltas


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        pieces.append(text[at:at + step])
        at += step
    return pieces


TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", '
             '"nested": {"brace": "}"}}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n'
             '</tool_call>')


def test_hermes_several_calls_with_content_before():
    content, calls = parse_whole(HermesToolParser(), TWO_CALLS)
    assert content == "I will look both up."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris, "FR"', "nested": {"brace": "}"}}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("seed", range(5))
def test_hermes_streamed_in_any_pieces_equals_whole(seed):
    whole_content, whole_calls = parse_whole(HermesToolParser(), TWO_CALLS)
    content, calls, deltas = parse_streamed(HermesToolParser(), random_pieces(TWO_CALLS, seed))
    assert content == whole_content
    strip_ids = lambda cs: [c["function"] for c in cs]  # noqa: E731 - ids are random per call
    assert strip_ids(calls) == strip_ids(whole_calls)
    # No text of a block ever leaks into content deltas.
    assert all("<" not in d.content and "tool" not in d.content for d in deltas)


def test_hermes_arguments_stream_before_the_block_closes():
    parser = HermesToolParser()
    assert parser.feed("<tool_call>\n").tool_calls == []
    first = parser.feed('{"name": "get_weather", "arguments": {"ci').tool_calls
    assert [d.to_openai() for d in first][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1].to_openai() == {"index": 0, "function": {"arguments": '{"ci'}}
    assert parser.feed('ty": "Oslo"}').tool_calls[0].arguments == 'ty": "Oslo"}'
    assert parser.feed("}\n</tool_call>").tool_calls == []  # the outer brace is not part of the arguments
    assert parser.message()[1][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_hermes_malformed_json_stays_content():
    text = 'Sure <tool_call>{"name": get_weather}</tool_call> and <tool_call>[1, 2]</tool_call>'
    content, calls = parse_whole(HermesToolParser(), text)
    assert calls == [] and content == text
    streamed, streamed_calls, _ = parse_streamed(HermesToolParser(), random_pieces(text, 1))
    assert streamed == text and streamed_calls == []


def test_hermes_text_without_calls_is_content_exactly():
    for text in ("", "  plain answer with < and <tool but no call \n", "ends with <tool_ca"):
        assert parse_whole(HermesToolParser(), text) == (text, [])
        assert parse_streamed(HermesToolParser(), random_pieces(text, 2))[0] == text


def test_hermes_output_cut_inside_a_call_keeps_the_partial_call():
    content, calls = parse_whole(HermesToolParser(), 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "Hi" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


def test_hermes_parallel_tool_calls_false_keeps_one_call():
    content, calls = parse_whole(HermesToolParser(max_calls=1), TWO_CALLS)
    assert len(calls) == 1 and content.startswith("I will look both up.<tool_call>")


def test_required_array_of_calls_streamed_and_whole():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = parse_whole(RequiredToolParser(), text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]
    streamed, streamed_calls, _ = parse_streamed(RequiredToolParser(), random_pieces(text, 3))
    assert streamed == "" and [c["function"] for c in streamed_calls] == [c["function"] for c in calls]


def test_named_output_is_the_arguments():
    content, calls, deltas = parse_streamed(NamedToolParser("get_weather"), ['{"city"', ': "Nice"}'])
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Nice"}'}
    assert deltas[0].tool_calls[0].to_openai()["id"].startswith("call_")


def test_plan_tool_choice():
    assert plan_tool_choice(None, None).new_parser is None
    assert plan_tool_choice([WEATHER], "none").new_parser is None
    assert isinstance(plan_tool_choice([WEATHER], None).new_parser(), HermesToolParser)
    named = plan_tool_choice([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.structured_outputs.json == WEATHER["function"]["parameters"]
    required = plan_tool_choice([WEATHER, TIME], "required", parallel_tool_calls=False).structured_outputs.json
    assert required["minItems"] == 1 and required["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    with pytest.raises(ValueError, match="'get_date', which is not in tools"):
        plan_tool_choice([WEATHER], {"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(ValueError, match="tool_choice 'required' needs tools"):
        plan_tool_choice(None, "required")
    with pytest.raises(ValueError, match="same function name"):
        plan_tool_choice([WEATHER, WEATHER], "auto")

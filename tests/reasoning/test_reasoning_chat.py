"""--reasoning-parser through /v1/chat/completions with the official openai client:
the thinking in reasoning_content (whole and streamed alike), the answer after it
following response_format or a forced tool call, enable_thinking passed to the
template, and include_reasoning."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from tests.conftest import assert_pool_free

MODEL = "tiny-thinker"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "Is it ok?"}]
TOOL = {"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def served(tiny_reasoning_model):
    """(openai client, the id of </think>)."""
    llm = LLM(tiny_reasoning_model, num_kv_blocks=128, max_model_len=1024)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name=MODEL,
                        reasoning_parser="qwen3")
    with TestClient(build_app(state)) as http:
        yield (openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0),
               llm.get_tokenizer().convert_tokens_to_ids("</think>"))
    assert_pool_free(llm)


def ask(client, end_id: int, seed: int, stream: bool = False, max_tokens: int = 64, **fields):
    """A seeded chat that makes </think> likely, so the random model thinks a few tokens, then answers."""
    return client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=max_tokens, temperature=1.0, seed=seed, stream=stream,
        logit_bias={str(end_id): 10.0}, **fields)


def test_the_answer_after_the_thinking_follows_the_schema(served):
    client, end_id = served
    schema_format = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    thoughts = []
    for seed in range(6):
        message = ask(client, end_id, seed, response_format=schema_format).choices[0].message
        thoughts.append(message.reasoning_content)
        jsonschema.validate(json.loads(message.content), SCHEMA)
        assert "</think>" not in message.reasoning_content and "<think>" not in message.content
    assert any(thoughts), thoughts  # some seed thought before answering


def test_a_stream_splits_as_the_whole_answer(served):
    client, end_id = served
    for seed in range(4):
        whole = ask(client, end_id, seed).choices[0].message
        chunks = list(ask(client, end_id, seed, stream=True))
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert (reasoning, content) == (whole.reasoning_content, whole.content)
        # the thinking streams before the answer: no reasoning delta after the first content delta
        kinds = ["content" if c.choices[0].delta.content else "reasoning" for c in chunks
                 if c.choices[0].delta.content or getattr(c.choices[0].delta, "reasoning_content", None)]
        assert kinds == sorted(kinds, key=lambda kind: kind == "content")


def test_a_forced_tool_call_comes_after_the_thinking(served, tiny_reasoning_model):
    client, end_id = served
    for seed in range(3):
        choice = ask(client, end_id, seed, max_tokens=200, tools=[TOOL], tool_choice="required",
                     parallel_tool_calls=False).choices[0]
        message = choice.message
        assert message.reasoning_content is not None and choice.finish_reason == "tool_calls"
        (call,) = message.tool_calls
        assert call.function.name == "answer"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_enable_thinking_false_reaches_the_template_and_the_output_is_all_answer(served):
    client, end_id = served
    message = ask(client, end_id, 0, response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}},
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), SCHEMA)  # the grammar held from the first token


def test_include_reasoning_false_leaves_the_thinking_out(served):
    client, end_id = served
    shown = ask(client, end_id, 1).choices[0].message
    hidden = ask(client, end_id, 1, extra_body={"include_reasoning": False}).choices[0].message
    assert shown.reasoning_content and getattr(hidden, "reasoning_content", None) is None
    assert hidden.content == shown.content


def test_a_parser_that_does_not_fit_the_model_refuses_to_serve(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=16)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name=MODEL,
                        reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="splits '<think>'"):
        build_app(state)
    assert_pool_free(llm)

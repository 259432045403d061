"""The rest of the request surface, in process on a tiny random model: echo,
prompt_logprobs, max_tokens 0, suffix, return_tokens_as_token_ids, the token
rules over HTTP, --max-logprobs, and fields that are refused or ignored."""

from __future__ import annotations

import json
import logging
import uuid

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.completions.serving import fill_in_the_middle
from tests.conftest import assert_pool_free_once_idle

PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, max_model_len=256, max_logprobs=5)


@pytest.fixture(scope="module")
def client(llm):
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name="tiny")
    with TestClient(build_app(state)) as test_client:
        yield test_client


@pytest.fixture(autouse=True)
def pool_is_free_afterwards(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_free_once_idle(request.getfixturevalue("llm"))


def complete(client: TestClient, **body) -> dict:
    response = client.post("/v1/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def error_of(client: TestClient, path: str, **body) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def stream_choices(client: TestClient, **body) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={"temperature": 0, "stream": True, **body}) as stream:
        events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event)["choices"][0] for event in events[:-1]]


def check_offsets(text: str, logprobs: dict) -> None:
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert text[offset : offset + len(token)] == token


def test_echo_with_logprobs_puts_the_prompt_first(client, llm) -> None:
    body = complete(client, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2)
    plain = complete(client, prompt=PROMPT, max_tokens=4, logprobs=2)
    choice, generated = body["choices"][0], plain["choices"][0]
    assert choice["text"] == PROMPT + generated["text"]
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    prompt_ids = reference.prompt_token_ids
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(prompt_ids)):
        expected = reference.prompt_logprobs[position][prompt_ids[position]].logprob
        assert logprobs["token_logprobs"][position] == pytest.approx(expected, abs=1e-5)
    assert logprobs["token_logprobs"][len(prompt_ids):] == generated["logprobs"]["token_logprobs"]
    for token, value, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        # The chosen token plus the 2 most likely (OpenAI: up to logprobs + 1 entries).
        assert top[token] == value and 2 <= len(top) <= 3
    check_offsets(choice["text"], logprobs)
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_max_tokens_0_needs_echo_and_returns_the_prompt_alone(client) -> None:
    body = complete(client, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=0, echo=True, logprobs=1)
    first, second = body["choices"]
    assert first["text"] == client.post("/detokenize", json={"tokens": [5, 6, 7, 8]}).json()["prompt"]
    assert len(first["logprobs"]["tokens"]) == 4 and first["finish_reason"] == "length"
    assert len(second["logprobs"]["tokens"]) == 2
    assert body["usage"]["completion_tokens"] == 0
    assert complete(client, prompt="Hi there", max_tokens=0, echo=True)["choices"][0]["text"] == "Hi there"
    assert error_of(client, "/v1/completions", prompt="hi", max_tokens=0)["param"] == "max_tokens"


def test_streamed_echo_sends_the_prompt_first_and_matches_the_whole_response(client) -> None:
    whole = complete(client, prompt=PROMPT, max_tokens=5, echo=True, logprobs=1)["choices"][0]
    choices = stream_choices(client, prompt=PROMPT, max_tokens=5, echo=True, logprobs=1)
    assert choices[0]["text"] == PROMPT
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = {key: [v for c in choices for v in c["logprobs"][key]] for key in whole["logprobs"]}
    assert streamed == whole["logprobs"]
    check_offsets(whole["text"], streamed)


def test_streamed_echo_only_and_prompt_logprobs_come_in_the_first_chunk(client) -> None:
    echo_only = stream_choices(client, prompt=PROMPT, max_tokens=0, echo=True)
    assert [c["text"] for c in echo_only] == [PROMPT, ""]
    assert [c["finish_reason"] for c in echo_only] == [None, "length"]
    whole = complete(client, prompt=PROMPT, max_tokens=3, prompt_logprobs=1)["choices"][0]
    streamed = stream_choices(client, prompt=PROMPT, max_tokens=3, prompt_logprobs=1)
    assert streamed[0]["text"] == "" and streamed[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert "".join(c["text"] for c in streamed) == whole["text"]


def test_prompt_logprobs_come_per_choice_in_vllms_shape(client, llm) -> None:
    body = complete(client, prompt=PROMPT, max_tokens=2, prompt_logprobs=3, n=2, temperature=1.0, seed=3)
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    for choice in body["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(reference.prompt_token_ids)
        for entry, expected in zip(entries[1:], reference.prompt_logprobs[1:]):
            assert {int(t) for t in entry} == set(expected)
            for token_id, value in entry.items():
                assert value["logprob"] == pytest.approx(expected[int(token_id)].logprob, abs=1e-5)
                assert value["rank"] == expected[int(token_id)].rank
                assert value["decoded_token"] == expected[int(token_id)].decoded_token
        assert choice["logprobs"] is None


def test_return_tokens_as_token_ids(client) -> None:
    body = complete(client, prompt=[11, 12, 13], max_tokens=2, echo=True, logprobs=1, return_tokens_as_token_ids=True)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"][:3] == ["token_id:11", "token_id:12", "token_id:13"]
    assert all(token.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for token in top)
    assert all(int(token.split(":")[1]) >= 0 for token in logprobs["tokens"][3:])


def test_suffix_without_fim_tokens_is_a_400_and_the_fim_prompt_is_built(client, tiny_llama) -> None:
    assert error_of(client, "/v1/completions", prompt="def f(", suffix="return x")["param"] == "suffix"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # a private copy: it gains FIM tokens here
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    built = fill_in_the_middle(tokenizer, "def f(x):\n", "    return y")
    assert built["prompt"] == "<fim_prefix>def f(x):\n<fim_suffix>    return y<fim_middle>"
    assert built["prompt_token_ids"] == tokenizer.encode(built["prompt"], add_special_tokens=False)
    vocab = tokenizer.get_vocab()
    assert fill_in_the_middle(tokenizer, {"prompt_token_ids": [7, 8]}, "z")["prompt_token_ids"] == [
        vocab["<fim_prefix>"], 7, 8, vocab["<fim_suffix>"], *tokenizer.encode("z", add_special_tokens=False),
        vocab["<fim_middle>"]]
    assert error_of(client, "/v1/completions", prompt="a", suffix="b", echo=True)["param"] == "suffix"


def test_token_rules_over_http_on_both_endpoints(client) -> None:
    token_text = client.post("/detokenize", json={"tokens": [1234]}).json()["prompt"]
    forced = complete(client, prompt=PROMPT, max_tokens=3, logit_bias={"1234": 100}, logprobs=0)
    assert forced["choices"][0]["logprobs"]["tokens"] == [token_text] * 3
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "allowed_token_ids": [1234], "logprobs": True}).json()
    assert [item["token"] for item in chat["choices"][0]["logprobs"]["content"]] == [token_text] * 4
    greedy = complete(client, prompt=PROMPT, max_tokens=1)["choices"][0]["text"]
    banned = complete(client, prompt=PROMPT, max_tokens=1, bad_words=[greedy])["choices"][0]["text"]
    assert banned != greedy
    cut = complete(client, prompt=list(range(100, 140)), max_tokens=1, truncate_prompt_tokens=7)
    assert cut["usage"]["prompt_tokens"] == 7
    assert error_of(client, "/v1/completions", prompt="hi", logit_bias={"99999999": 1})["param"] == "logit_bias"


def test_max_logprobs_is_a_400_naming_the_field(client) -> None:
    assert error_of(client, "/v1/completions", prompt="hi", logprobs=6)["param"] == "logprobs"
    assert error_of(client, "/v1/completions", prompt="hi", prompt_logprobs=6)["param"] == "prompt_logprobs"
    assert error_of(client, "/v1/completions", prompt="hi", echo=True, logprobs=6)["param"] == "logprobs"
    chat = error_of(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                    logprobs=True, top_logprobs=6)
    assert chat["param"] == "top_logprobs" and "--max-logprobs" in chat["message"]
    assert complete(client, prompt="hi", max_tokens=1, logprobs=5)["choices"][0]["logprobs"] is not None


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "store", True),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "add_special_tokens", False),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
])
def test_an_unimplemented_field_is_a_400_naming_it(client, path, field, value) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    error = error_of(client, path, **body, **{field: value})
    assert error["param"] == field and field in error["message"]


def test_unimplemented_fields_at_their_defaults_and_unknown_fields_are_accepted(client) -> None:
    logger = logging.getLogger("pagedllm.entrypoints.openai.common.protocol")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    unknown = f"x_unknown_{uuid.uuid4().hex[:8]}"
    try:
        for _ in range(3):
            complete(client, prompt="hi", max_tokens=1, store=False, use_beam_search=False, service_tier="auto",
                     **{unknown: 1})
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if unknown in r.getMessage()]
    assert len(warnings) == 1 and "ignoring the unknown field" in warnings[0]

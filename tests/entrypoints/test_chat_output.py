"""The chat response bodies with a tool parser: a whole message, and a stream of
chunks fed token by token as the engine produces them."""

from __future__ import annotations

from pagedllm.entrypoints.openai.chat.choices import ChatChoices
from pagedllm.entrypoints.openai.chat.encoder import ChatEncoder
from pagedllm.entrypoints.openai.chat.output import ChatOutput
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

OUTPUT = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def outputs_token_by_token(text: str, pieces: int = 7) -> list[RequestOutput]:
    """The engine's successive outputs for a choice whose text grows ``pieces`` characters a step."""
    steps = []
    for end in range(pieces, len(text) + pieces, pieces):
        done = end >= len(text)
        completion = CompletionOutput(0, text[:end], list(range(end // pieces)), None, None,
                                      "stop" if done else None)
        steps.append(RequestOutput("r", None, [1, 2], None, [completion], done))
    return steps


class ChatBodies:
    """Chat's events for the outputs, rendered by the chat completions encoder."""

    def __init__(self, params: SamplingParams, output: ChatOutput | None = None) -> None:
        self.choices = ChatChoices(params, output or ChatOutput(None))
        self.encoder = ChatEncoder(None, "chatcmpl", params.logprobs, "m")

    def full(self, finals: list[RequestOutput]) -> dict:
        return self.encoder.body(self.choices.result(finals))

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        return [self.encoder.chunk(event) for event in self.choices.deltas(prompt_index, output)]


def builder() -> ChatBodies:
    return ChatBodies(SamplingParams(), ChatOutput(HermesToolParser))


def test_whole_message_has_tool_calls_and_finish_reason_tool_calls():
    final = outputs_token_by_token(OUTPUT)[-1]
    choice = builder().full([final])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_stream_sends_openai_tool_call_deltas_and_no_block_text_as_content():
    response = builder()
    chunks = [chunk for step in outputs_token_by_token(OUTPUT) for chunk in response.chunks(0, step)]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert set(calls[0]) == {"index", "id", "type", "function"} and calls[0]["function"]["arguments"] == ""
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert len(calls) > 2  # the arguments came in several pieces, before the block closed
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(d for d in deltas[:-1])  # no empty chunk while the parser holds text back
    assert deltas[-1] == {}  # the finishing chunk, as OpenAI sends it


def test_without_a_parser_the_message_is_plain_content():
    final = outputs_token_by_token(OUTPUT)[-1]
    plain = ChatBodies(SamplingParams())
    choice = plain.full([final])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": OUTPUT} and choice["finish_reason"] == "stop"


def test_each_choice_of_n_has_its_own_parser():
    texts = [OUTPUT, "Just text."]
    response = ChatBodies(SamplingParams(n=2), ChatOutput(HermesToolParser))
    chunks = []
    for step in range(1, max(len(t) for t in texts) + 1):
        completions = [CompletionOutput(i, t[:step], [0] * step, None, None, "stop" if step >= len(t) else None)
                       for i, t in enumerate(texts) if step <= len(t)]
        chunks += response.chunks(0, RequestOutput("r", None, [1], None, completions, step >= len(OUTPUT)))
    by_choice = {0: [], 1: []}
    for chunk in chunks:
        by_choice[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    assert "".join(c["delta"].get("content", "") for c in by_choice[1]) == "Just text."
    assert by_choice[1][-1]["finish_reason"] == "stop" and by_choice[0][-1]["finish_reason"] == "tool_calls"
    assert not any("tool_calls" in c["delta"] for c in by_choice[1])

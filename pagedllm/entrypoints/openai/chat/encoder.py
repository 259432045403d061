"""Chat completions' rendering of chat's events: ``chat.completion`` bodies and
``chat.completion.chunk``s, OpenAI's field order kept."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedllm.entrypoints.openai.chat.events import ChatEvent, ChatResult, ChoiceDelta, ChoiceResult, EngineFailure
from pagedllm.entrypoints.openai.common.errors import error_body
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.common.logprobs import json_logprob
from pagedllm.outputs import PositionLogprobs


class ChatEncoder:
    """The bodies of one chat completions request; ``kind`` prefixes its id."""

    def __init__(self, tokenizer: Any, kind: str, num_top_logprobs: int | None, model: str,
                 include_usage: bool = False) -> None:
        self.tokenizer = tokenizer
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_top_logprobs = num_top_logprobs or 0
        self.model = model
        self.include_usage = include_usage

    def body(self, result: ChatResult) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice(choice) for choice in result.choices], "usage": result.usage.to_openai()}

    def chunk(self, event: ChatEvent) -> dict[str, Any]:
        """The chunk of one event (an engine failure: the error a 503 would carry)."""
        if isinstance(event, EngineFailure):
            return error_body(event.message, "server_error", code="engine_dead")
        if isinstance(event, Usage):
            return {**self._head(), "choices": [], "usage": event.to_openai()}
        chunk = {**self._head(), "choices": [self._choice_delta(event)]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    def _choice(self, choice: ChoiceResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant"}
        if choice.shows_reasoning:
            message["reasoning_content"] = choice.reasoning
        message["content"] = choice.content
        if choice.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in choice.tool_calls]
        # vLLM's stop_reason: the stop string or token id that ended the choice (Messages' stop_sequence)
        return {"index": choice.index, "finish_reason": choice.finish_reason, "logprobs": self._logprobs(choice.logprobs),
                "stop_reason": choice.stop_reason, "message": message}

    def _choice_delta(self, event: ChoiceDelta) -> dict[str, Any]:
        message = event.message
        delta: dict[str, Any] = {}
        if message.reasoning:
            delta["reasoning_content"] = message.reasoning
        if message.content:
            delta["content"] = message.content
        if message.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in message.tool_calls]
        if event.first:
            delta["role"] = "assistant"
        return {"index": event.index, "logprobs": self._logprobs(event.logprobs),
                "finish_reason": message.finish_reason, "delta": delta, "stop_reason": event.stop_reason}

    def _logprobs(self, positions: list[PositionLogprobs] | None) -> dict[str, Any] | None:
        """{"content": [{token, logprob, bytes, top_logprobs}]} (completions: ``CompletionChoices.logprobs``)."""
        if positions is None:
            return None
        entries = []
        for entry in positions:
            chosen = next(iter(entry.items()))  # the sampler puts the sampled token first
            top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:self.num_top_logprobs]
            entries.append((chosen, top))

        def item(token_id, lp):
            text = lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])
            return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode())}
        return {"content": [{**item(*chosen), "top_logprobs": [item(*t) for t in top]} for chosen, top in entries]}

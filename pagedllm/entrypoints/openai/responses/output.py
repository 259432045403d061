"""The Response object of the Responses API and its stream of events: the
Responses encoder of chat's typed events (``chat.events``: the whole
``ChatResult``, or the stream's steps). One builder does both: a whole answer is fed as
one delta, so a stream and a whole response end with the same output items.

Output items, in order: a ``reasoning`` item (the thinking, under
--reasoning-parser), a ``message`` item (the answer's text; always there unless
the model called functions), then one ``function_call`` item per call. Events
follow OpenAI's order, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, then per item ``response.output_item.added``, (text
items) ``response.content_part.added``, the deltas, their ``.done``,
``response.content_part.done``, ``response.output_item.done``; last
``response.completed``, ``response.incomplete`` (cut by max_output_tokens) or
``response.failed`` (the engine died).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.chat.events import ChatResult, ChoiceDelta, MessageDelta
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.responses.protocol import FunctionToolChoice, ResponsesRequest
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallDelta

# Text item kind -> (id prefix, content part type, event name prefix).
_TEXT_ITEMS = {"message": ("msg", "output_text", "response.output_text"),
               "reasoning": ("rs", "reasoning_text", "response.reasoning_text")}


# Every event type a stream sends (the OpenAPI document lists them).
STREAM_EVENTS = ("response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done",
                 "response.content_part.done", "response.output_item.done", "response.completed",
                 "response.incomplete", "response.failed")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echo_fields(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The request's settings a Response repeats (the openai client's Response needs them)."""
    choice = body.tool_choice
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "model": model, "instructions": body.instructions,
        "tools": [tool.model_dump() for tool in body.tools or ()],
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "text": {"format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"}},
        "previous_response_id": body.previous_response_id, "store": body.stored, "metadata": body.metadata or {},
        "user": body.user, "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "background": False,
    }


class ResponseAssembler:
    """One response's output items and events. ``count_tokens`` counts the
    thinking's tokens for ``usage.output_tokens_details.reasoning_tokens``."""

    def __init__(self, echo: dict[str, Any], count_tokens: Callable[[str], int]) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.echo = echo
        self.count_tokens = count_tokens
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None  # the item deltas go to
        self._calls: dict[int, dict[str, Any]] = {}  # a chat tool call's index -> its function_call item
        self._sequence = 0

    def response(self) -> dict[str, Any]:
        """The Response object as it stands."""
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        done = self.status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "completed_at": int(time.time()) if done else None, "error": self.error,
                "incomplete_details": incomplete, **self.echo, "output": copy.deepcopy(self.output),
                "usage": self.usage}

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed_event(self, event: ChoiceDelta | Usage) -> list[dict[str, Any]]:
        """The events of one of chat's stream events (a step of the choice, or the usage)."""
        if isinstance(event, Usage):
            self._set_usage(event)
            return []
        events = self.feed(event.message)
        self.finish_reason = event.message.finish_reason or self.finish_reason
        return events

    def feed_result(self, result: ChatResult) -> None:
        """A whole chat answer: its message as one delta."""
        choice = result.choices[0]
        calls = tuple(ToolCallDelta(i, call.arguments, call.id, call.name) for i, call in enumerate(choice.tool_calls))
        self.feed(MessageDelta(choice.reasoning, choice.content, calls))
        self.finish_reason = choice.finish_reason
        self._set_usage(result.usage)

    def feed(self, delta: MessageDelta) -> list[dict[str, Any]]:
        """The events of a chat delta: thinking, answer text, tool calls."""
        events = []
        if delta.reasoning:
            events += self._add_text("reasoning", delta.reasoning)
        if delta.content:
            events += self._add_text("message", delta.content)
        for call in delta.tool_calls:
            events += self._add_call(call)
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the last item (an output without text or calls gets an empty message,
        so every answer has one) and settle the status; the final event is ``final_event``."""
        self.status = "incomplete" if self.finish_reason == "length" else "completed"
        events = self._close(self.status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self._open_text("message") + self._close(self.status)
        return events

    def final_event(self) -> dict[str, Any]:
        return self._event(f"response.{self.status}", response=self.response())

    def fail(self, message: str) -> list[dict[str, Any]]:
        """The engine died: the open item stays incomplete and the response fails."""
        if self._open is not None:
            self._open["status"] = "incomplete"
        self.status, self.error = "failed", {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    def _set_usage(self, usage: Usage) -> None:
        thinking = "".join(part["text"] for item in self.output if item["type"] == "reasoning"
                           for part in item["content"])
        output_tokens = usage.completion_tokens
        # Re-encoding the thinking's text: the chat path reports no per-part token counts.
        reasoning_tokens = min(self.count_tokens(thinking), output_tokens) if thinking else 0
        self.usage = {"input_tokens": usage.prompt_tokens,
                      # prefix caching is automatic: nothing is charged as a cache write
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": usage.prompt_tokens + output_tokens}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def _add_text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self._open is not None and self._open["type"] == kind else self._open_text(kind)
        item, (_, part_type, prefix) = self._open, _TEXT_ITEMS[kind]
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(f"{prefix}.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                     content_index=0, delta=text, **extra)]

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        events = self._close("completed")
        id_prefix, part_type, _ = _TEXT_ITEMS[kind]
        if kind == "message":
            item = {"id": new_id(id_prefix), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": part_type, "text": "", "annotations": []}
        else:
            item = {"id": new_id(id_prefix), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": part_type, "text": ""}
        events.append(self._open_item(item))
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, part=part))
        return events

    def _add_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:  # a new call: its header first
            events += self._close("completed")
            item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id,
                    "name": call.name, "arguments": "", "status": "in_progress"}
            self._calls[call.index] = item
            events.append(self._open_item(item))
        item = self._calls[call.index]
        piece = call.arguments
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=piece))
        return events

    def _open_item(self, item: dict[str, Any]) -> dict[str, Any]:
        self.output.append(item)
        self._open = item
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The ``.done`` events of the open item, which ends with ``status``."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"])]
        else:
            part = item["content"][0]
            prefix = _TEXT_ITEMS[item["type"]][2]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self._event(f"{prefix}.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=part["text"], **extra),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

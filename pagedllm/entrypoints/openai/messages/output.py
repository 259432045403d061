"""The Messages encoder of chat's typed events (``chat.events``): the whole
message from a ``ChatResult``, and Anthropic's event stream from the stream's steps.

Content blocks come in the order chat parses them: the thinking, the text, then one ``tool_use`` block per call. The
stream opens a block when its first piece arrives and closes it when another
kind begins, so empty text or thinking makes no block, whole or streamed.

Usage follows Anthropic's split: ``input_tokens`` excludes the prompt tokens the
prefix cache held (``cache_read_input_tokens``), so the two add up to the
prompt; nothing is charged for writing the cache (``cache_creation_input_tokens``
is 0). A stream's ``message_start`` cannot know the cache hits yet: it counts
the whole prompt as ``input_tokens``, and ``message_delta`` gives the final split.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pagedllm.entrypoints.openai.chat.events import ChatEvent, ChatResult, ChoiceDelta, EngineFailure
from pagedllm.entrypoints.openai.common import sse
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallDelta

# Event types of a stream, in the order they come ("error" ends one early).
STREAM_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop", "error")


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """Chat's call id in Anthropic's spelling (``call_x`` -> ``toolu_x``)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason_of(finish_reason: str | None, matched: Any) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat choice's finish reason and
    vLLM's ``stop_reason`` (the stop string that matched, if one did)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage_of(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``input``: {} when they are not a whole JSON object
    (a call cut by ``max_tokens``, whose stop_reason says so; a stream has sent
    the partial JSON as it came)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_of(result: ChatResult, model: str, message_id: str) -> dict[str, Any]:
    """The Messages response of a whole chat answer (one choice)."""
    choice = result.choices[0]
    content: list[dict[str, Any]] = []
    if choice.reasoning:
        content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    for call in choice.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                        "input": tool_input(call.arguments)})
    stop_reason, stop_sequence = stop_reason_of(choice.finish_reason, choice.stop_reason)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_of(result.usage)}


Event = tuple[str, dict[str, Any]]


class MessageStream:
    """Anthropic's events for one streamed chat answer's events."""

    def __init__(self, model: str, message_id: str, prompt_tokens: int) -> None:
        self.model, self.id, self.prompt_tokens = model, message_id, prompt_tokens
        self.kinds: list[str] = []  # each started block's type; the last is open until closed
        self.open = False
        self.call_blocks: dict[int, int] = {}  # chat's tool call index -> its block's index
        self.finish_reason: str | None = None
        self.matched: Any = None
        self.usage: Usage | None = None

    def start(self) -> list[Event]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [("message_start", {"message": message})]

    def event(self, event: ChoiceDelta | Usage) -> list[Event]:
        if isinstance(event, Usage):
            self.usage = event
            return []
        events: list[Event] = []
        delta = event.message
        if delta.reasoning:
            events += self._piece("thinking", {"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            events += self._piece("text", {"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls:
            events += self._call_piece(call)
        if delta.finish_reason is not None:
            self.finish_reason, self.matched = delta.finish_reason, event.stop_reason
        return events

    def end(self) -> list[Event]:
        stop_reason, stop_sequence = stop_reason_of(self.finish_reason, self.matched)
        usage = usage_of(self.usage) if self.usage is not None else {"output_tokens": 0}
        return [*self._close(), ("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                                    "usage": usage}),
                ("message_stop", {})]

    def _close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"index": len(self.kinds) - 1})]

    def _begin(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.kinds.append(block["type"])
        self.open = True
        return [*events, ("content_block_start", {"index": len(self.kinds) - 1, "content_block": block})]

    def _piece(self, kind: str, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if not (self.open and self.kinds[-1] == kind):
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            events = self._begin(block)
        return [*events, ("content_block_delta", {"index": len(self.kinds) - 1, "delta": delta})]

    def _call_piece(self, call: ToolCallDelta) -> list[Event]:
        """A call's first delta opens its tool_use block; its argument pieces are input_json_deltas."""
        events: list[Event] = []
        if call.id is not None:
            events = self._begin({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}})
            self.call_blocks[call.index] = len(self.kinds) - 1
        if call.arguments:
            events.append(("content_block_delta", {"index": self.call_blocks[call.index], "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
        return events


def server_sent_event(kind: str, data: dict[str, Any]) -> str:
    return sse.named_event(kind, {"type": kind, **data})


async def message_events(chat_events: AsyncGenerator[ChatEvent, None], stream: MessageStream) -> AsyncIterator[str]:
    """The SSE text of chat's events (``chat.serving.generate_chat``'s); an engine that
    died mid-stream ends it with an ``error`` event. Closing this closes ``chat_events``,
    which aborts the request (a client that went away)."""
    try:
        for kind, data in stream.start():
            yield server_sent_event(kind, data)
        async for event in chat_events:
            if isinstance(event, EngineFailure):
                yield server_sent_event("error", {"error": {"type": "api_error", "message": event.message}})
                return
            for kind, data in stream.event(event):
                yield server_sent_event(kind, data)
        for kind, data in stream.end():
            yield server_sent_event(kind, data)
    finally:
        await chat_events.aclose()

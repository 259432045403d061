"""What chat produces, as types: the events of a streamed answer and the whole
answer. Chat completions, the Responses API and the Messages API each render
these in their own JSON and SSE (``chat.encoder``, ``responses.output``,
``messages.output``); none of them reads another's bodies."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallDelta
from pagedllm.outputs import PositionLogprobs


@dataclass(frozen=True)
class MessageDelta:
    """What a choice's new text adds to its message once the reasoning splitter and
    the tool parser have read it. ``reasoning`` is None when there is none or the
    request hides it (``include_reasoning``)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """One step of one choice in a stream. ``first``: the choice's first event
    (chat sends the role with it). ``logprobs``: the step's tokens', when asked for."""

    index: int
    first: bool
    message: MessageDelta
    stop_reason: int | str | None
    logprobs: list[PositionLogprobs] | None


@dataclass(frozen=True)
class EngineFailure:
    """The engine died mid-stream: the last event."""

    message: str


# A stream's events: choice steps, then the usage when the request asked for it.
ChatEvent = ChoiceDelta | Usage | EngineFailure


@dataclass(frozen=True)
class ToolCall:
    """A whole call of the final message."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice. ``reasoning`` is None when there was no thinking;
    ``shows_reasoning`` says whether the message carries the field at all (a
    reasoning parser runs and the request did not hide it)."""

    index: int
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    reasoning: str | None
    shows_reasoning: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[PositionLogprobs] | None


@dataclass(frozen=True)
class ChatResult:
    """The whole answer: every choice, and the usage."""

    choices: list[ChoiceResult]
    usage: Usage

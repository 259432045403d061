"""Running the prompts of one API request on the engine: adding them, their
final outputs, and the stream of their outputs as they come, which every
generation API turns into its own events. Which bodies answer is each API's
(``chat.encoder``, ``completions.bodies``, ``responses.output``, ``messages.output``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import EngineDeadError, RequestStream
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.common import sse
from pagedllm.entrypoints.openai.common.errors import bad_request, error_responses
from pagedllm.entrypoints.openai.common.state import ServerState, cache_salt_of
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Event = TypeVar("Event")

# The answers of the generation routes: JSON, or SSE events with ``"stream": true``.
GENERATION_RESPONSES = {
    200: {"description": "the whole response (JSON), or with `stream` true its chunks as server-sent events",
          "content": sse.stream_content(sse.event_schema("a chunk as JSON; the last event's is [DONE]"))},
    **error_responses(400, 401, 404, 503),
}


async def add_prompts(state: ServerState, kind: str, prompts: list[PromptType], params: SamplingParams,
                      body: Any, tenant: str | None, lora_request: LoRARequest | None) -> list[RequestStream]:
    """Add every prompt under ``lora_request``'s adapter (None: the base). Raises
    ``APIError`` 400 when the engine refuses a prompt."""
    salt = cache_salt_of(tenant, body.cache_salt)
    engine = state.async_engine
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            rid = engine.next_request_id(kind)
            streams.append(await engine.add_request(rid, prompt, params, priority=body.priority, cache_salt=salt,
                                                    lora_request=lora_request))
    except ValueError as exc:
        for stream in streams:
            stream.abort()
        raise bad_request(exc, type(body).model_fields) from exc
    return streams


async def finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """Every stream's final output (the whole answer)."""
    try:
        return list(await asyncio.gather(*(_last(stream) for stream in streams)))
    finally:
        for stream in streams:
            stream.abort()


def sse_response(events: AsyncIterator[Event], encode: Callable[[Event], dict[str, Any]]) -> StreamingResponse:
    """Each event's chunk (``encode``) as an unnamed ``data:`` event, closed by
    ``[DONE]`` (chat and completions); a chunk with an ``error`` ends the stream without it."""
    return StreamingResponse(_server_sent_events(events, encode), media_type=sse.MEDIA_TYPE)


async def _server_sent_events(events: AsyncIterator[Event], encode: Callable[[Event], dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            chunk = encode(event)
            yield sse.data_event(chunk)
            if "error" in chunk:
                return
        yield sse.DONE
    finally:
        await events.aclose()  # a client that went away: the request is aborted


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


async def _tagged_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | EngineDeadError]]:
    """Every stream's outputs as they come, each with its stream's index; an
    engine that dies ends a stream with its ``EngineDeadError``. Closing this
    generator cancels what it started."""
    if len(streams) == 1:  # most requests: no task and queue hop per token
        try:
            async for output in streams[0]:
                yield 0, output
        except EngineDeadError as exc:
            yield 0, exc
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | EngineDeadError | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except EngineDeadError as exc:
            await merged.put((index, exc))
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, output = await merged.get()
            if output is None:
                remaining -= 1
            else:
                yield index, output
        for task in tasks:
            task.result()  # re-raise a failure of the stream itself
    finally:
        for task in tasks:
            task.cancel()


async def stream_events(streams: list[RequestStream], step: Callable[[int, RequestOutput], list[Event]],
                        end: Callable[[list[RequestOutput]], list[Event]],
                        failure: Callable[[str], Event]) -> AsyncIterator[Event]:
    """An API's events for every prompt's outputs as they come: ``step`` of each
    (prompt index, output), ``end`` of the final outputs; when the engine dies
    mid-stream, ``failure`` of its message is the last. Aborts everything left if
    the consumer goes away (the generator is cancelled or closed)."""
    last: dict[int, RequestOutput] = {}
    outputs = _tagged_outputs(streams)
    try:
        async for index, output in outputs:
            if isinstance(output, EngineDeadError):
                yield failure(str(output))
                return
            for event in step(index, output):
                yield event
            if output.finished:
                last[index] = output
        for event in end([last[i] for i in sorted(last)]):
            yield event
    finally:
        await outputs.aclose()
        for stream in streams:
            stream.abort()

"""Running the prompts of one API request on the engine, and answering with a
whole response or a stream of SSE chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import EngineDeadError, RequestStream
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.chat.output import ChatOutput
from pagedllm.entrypoints.openai.completions.choices import CompletionOptions
from pagedllm.entrypoints.openai.common import sse
from pagedllm.entrypoints.openai.common.errors import bad_request, error_body, error_responses
from pagedllm.entrypoints.openai.common.openai_bodies import ResponseBuilder
from pagedllm.entrypoints.openai.common.state import ServerState, cache_salt_of
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


# The answers of the generation routes: JSON, or SSE events with ``"stream": true``.
GENERATION_RESPONSES = {
    200: {"description": "the whole response (JSON), or with `stream` true its chunks as server-sent events",
          "content": sse.stream_content(sse.event_schema("a chunk as JSON; the last event's is [DONE]"))},
    **error_responses(400, 401, 404, 503),
}


async def serve(state: ServerState, kind: str, prompts: list[PromptType], params: SamplingParams,
                body, tenant: str | None, chat: bool, completion: CompletionOptions | None = None,
                output: ChatOutput | None = None, lora_request: LoRARequest | None = None):
    """The HTTP answer of ``generate``: JSON, or its chunks as SSE events."""
    answer = await generate(state, kind, prompts, params, body, tenant, chat, completion, output, lora_request)
    if isinstance(answer, dict):
        return answer
    return StreamingResponse(_server_sent_events(answer), media_type=sse.MEDIA_TYPE)


async def generate(state: ServerState, kind: str, prompts: list[PromptType], params: SamplingParams,
                   body, tenant: str | None, chat: bool, completion: CompletionOptions | None = None,
                   output: ChatOutput | None = None,
                   lora_request: LoRARequest | None = None) -> dict | AsyncIterator[dict]:
    """Add every prompt under ``lora_request``'s adapter (None: the base) and
    answer: the whole response, or (``body.stream``) an iterator of its chunks,
    whose last is ``{"error": ...}`` if the engine died mid-stream. The Responses
    and Messages APIs answer from these chat chunks too. Raises ``APIError`` 400
    when the engine refuses a prompt."""
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
    response = ResponseBuilder(state.engine_info.tokenizer, kind, params, chat, body.model or state.served_model_name,
                               completion=completion, output=output)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(response, streams, include_usage)
    try:
        finals = await asyncio.gather(*(_last(stream) for stream in streams))
    finally:
        for stream in streams:
            stream.abort()
    return response.full(finals)


async def _server_sent_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield sse.data_event(chunk)
        if "error" in chunk:
            return
    yield sse.DONE


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


async def _stream(response: ResponseBuilder, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[dict]:
    """The chunks of every prompt's outputs as they come; aborts everything left
    if the consumer goes away (the generator is cancelled or closed). When the
    engine dies mid-stream the last chunk is the error a 503 would carry
    (``{"error": {..., "code": "engine_dead"}}``)."""
    finals: dict[int, RequestOutput] = {}
    outputs = _tagged_outputs(streams)
    try:
        async for index, output in outputs:
            if isinstance(output, EngineDeadError):
                yield error_body(str(output), "server_error", code="engine_dead")
                return
            for chunk in response.chunks(index, output, include_usage):
                yield chunk
            if output.finished:
                finals[index] = output
        if include_usage:
            yield response.usage_chunk([finals[i] for i in sorted(finals)])
    finally:
        await outputs.aclose()
        for stream in streams:
            stream.abort()

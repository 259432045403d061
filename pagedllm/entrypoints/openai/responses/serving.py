"""OpenAI's Responses API: ``POST /v1/responses`` (whole, or streamed as the
Responses events), ``GET`` and ``DELETE /v1/responses/{id}`` for stored ones.

One implementation under this front door: the request becomes a chat request
(``responses.input``), runs as chat completions do (``prepare_chat``,
``generate_chat``) and chat's typed answer becomes the Response (``responses.output``).
Stored responses (``store``, the default, and ``previous_response_id``) live in
``ServerState.responses_store``, per tenant (``responses.store``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.common.disconnect import cancel_on_disconnect
from pagedllm.entrypoints.openai.common import routes, sse
from pagedllm.entrypoints.openai.common.errors import APIError, ErrorResponse, error_responses
from pagedllm.entrypoints.openai.responses.protocol import ResponsesRequest
from pagedllm.entrypoints.openai.responses.input import (CHAT_TO_RESPONSES_FIELDS, input_messages, output_messages,
                                                         to_chat_request)
from pagedllm.entrypoints.openai.responses.output import STREAM_EVENTS, ResponseAssembler, echo_fields
from pagedllm.entrypoints.openai.chat.events import ChatEvent, ChatResult, EngineFailure
from pagedllm.entrypoints.openai.chat.serving import generate_chat, prepare_chat
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency

CREATE_RESPONSES = {
    200: {"description": "the Response (JSON), or with `stream` true its events as server-sent events",
          "content": sse.stream_content(sse.event_schema(
              "the event as JSON (its type and sequence_number included)", STREAM_EVENTS))},
    **error_responses(400, 401, 503),
    404: {"model": ErrorResponse, "description": "the request's `model` is not served here, or its "
                                                 "`previous_response_id` names no response stored for this API key"},
}
STORED_RESPONSES = {
    **error_responses(401, 503),
    404: {"model": ErrorResponse, "description": "no response of this id is stored for this API key (never stored, "
                                                 "evicted, deleted, or another tenant's)"},
}


def add_responses_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post(routes.RESPONSES, responses=CREATE_RESPONSES)
    @cancel_on_disconnect
    async def create_response(body: ResponsesRequest, request: Request, tenant: str | None = Depends(tenant_of)):
        previous = _previous_conversation(state, body, tenant)
        with _named_as_responses_fields():
            chat_body = to_chat_request(body, previous)
            job = prepare_chat(state, chat_body)
            answer = await generate_chat(state, "resp", job, chat_body, tenant)
        tokenizer = state.engine_info.tokenizer
        assembler = ResponseAssembler(echo_fields(body, chat_body.model or state.served_model_name),
                                      lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
        conversation = previous + input_messages(body)
        if isinstance(answer, ChatResult):
            assembler.start()
            assembler.feed_result(answer)
            assembler.finish()
            _keep(state, tenant, assembler, conversation)
            return assembler.response()
        return StreamingResponse(_events(state, tenant, assembler, conversation, answer),
                                 media_type=sse.MEDIA_TYPE)

    @app.get(routes.STORED_RESPONSE, responses=STORED_RESPONSES)
    async def get_response(response_id: str, tenant: str | None = Depends(tenant_of)) -> dict:
        stored = state.responses_store.get(tenant, response_id)
        if stored is None:
            raise _not_stored(response_id)
        return stored.response

    @app.delete(routes.STORED_RESPONSE, responses=STORED_RESPONSES)
    async def delete_response(response_id: str, tenant: str | None = Depends(tenant_of)) -> dict:
        if not state.responses_store.delete(tenant, response_id):
            raise _not_stored(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # Starlette answers another method with the 405 of the first route of the path, which would
    # allow GET alone: this one answers it with both.
    @app.api_route(routes.STORED_RESPONSE, methods=["HEAD", "OPTIONS", "POST", "PUT", "PATCH", "TRACE"], include_in_schema=False)
    async def other_method(response_id: str) -> None:
        raise StarletteHTTPException(405, "Method Not Allowed", headers={"Allow": "GET, DELETE"})


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {response_id!r}.", code="response_not_found")


def _previous_conversation(state: ServerState, body: ResponsesRequest, tenant: str | None) -> list[dict[str, Any]]:
    """The conversation stored with ``previous_response_id`` ([] without one); 404 as OpenAI when
    this tenant has none of that id."""
    if body.previous_response_id is None:
        return []
    stored = state.responses_store.get(tenant, body.previous_response_id)
    if stored is None:
        raise APIError(404, f"Previous response with id {body.previous_response_id!r} not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return stored.conversation


@contextmanager
def _named_as_responses_fields() -> Iterator[None]:
    """The chat path's 400s name chat fields (``messages``, ``response_format``): name
    the Responses fields the client sent instead."""
    try:
        yield
    except ValidationError as exc:  # the chat request refused what the Responses request let through
        error = exc.errors()[0]
        location = ".".join(map(str, error["loc"]))
        raise _as_responses_error(APIError(400, f"{location}: {error['msg']}", param=location or None)) from exc
    except APIError as exc:
        raise _as_responses_error(exc) from exc


def _as_responses_error(exc: APIError) -> APIError:
    head = (exc.param or "").partition(".")[0]
    if head not in CHAT_TO_RESPONSES_FIELDS:
        return exc
    exc.param = CHAT_TO_RESPONSES_FIELDS[head]  # a message's index in chat's list is not the input's
    if exc.param == "input":
        exc.message += " (input, as the chat messages it becomes after instructions and the previous response's)"
    else:
        exc.message = re.sub(rf"\b{head}\b", exc.param, exc.message)
    return exc


def _keep(state: ServerState, tenant: str | None, assembler: ResponseAssembler,
          conversation: list[dict[str, Any]]) -> None:
    """Store a finished response when asked; one the store cannot hold (over its byte
    bound, or the store is off) says ``store: false``, so the client knows."""
    if not assembler.echo["store"]:
        return
    response = assembler.response()
    if not state.responses_store.put(tenant, response, conversation + output_messages(response["output"])):
        assembler.echo["store"] = False


async def _events(state: ServerState, tenant: str | None, assembler: ResponseAssembler,
                  conversation: list[dict[str, Any]], chat_events: AsyncIterator[ChatEvent]) -> AsyncIterator[str]:
    """The Responses events of a streamed chat answer, as SSE; the response is stored
    before the last event. Closing this closes the chat stream (aborting the request)."""
    try:
        yield _sse(assembler.start())
        async for chat_event in chat_events:
            if isinstance(chat_event, EngineFailure):
                yield _sse(assembler.fail(chat_event.message))
                return
            events = assembler.feed_event(chat_event)
            if events:
                yield _sse(events)
        events = assembler.finish()
        _keep(state, tenant, assembler, conversation)
        yield _sse(events + [assembler.final_event()])
    finally:
        await chat_events.aclose()


def _sse(events: list[dict[str, Any]]) -> str:
    return "".join(sse.named_event(event["type"], event) for event in events)


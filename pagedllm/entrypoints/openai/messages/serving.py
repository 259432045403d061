"""The Anthropic Messages API: POST /v1/messages (whole, or Anthropic's event
stream) and POST /v1/messages/count_tokens.

One implementation under this front door: a Messages request becomes a chat
completions request (``messages.to_chat.to_chat_request``), runs through chat's
checks, rendering, tool parsing, grammars and reasoning split (``prepare_chat``,
``generate_chat``), and chat's typed answer is rendered as Anthropic's (``messages.output``).

Errors on these paths are Anthropic-shaped (``{"type": "error", "error": {"type",
"message"}}``, same statuses): ``AnthropicErrors`` rewrites every error answer
of the routes, whoever raised it (validation, the key check, chat's checks, the
503 while the model loads), so the rest of the server keeps OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.common.disconnect import cancel_on_disconnect
from pagedllm.entrypoints.openai.common import routes, sse
from pagedllm.entrypoints.openai.common.errors import APIError, bad_request
from pagedllm.entrypoints.openai.messages.output import (
    STREAM_EVENTS, MessageStream, message_events, message_of, new_message_id,
)
from pagedllm.entrypoints.openai.messages.to_chat import THINKING_SWITCH, to_chat_request
from pagedllm.entrypoints.openai.common.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.messages.protocol import (
    AnthropicErrorResponse, CountTokensResponse, MessageResponse, MessagesCountTokensRequest, MessagesRequest,
    ThinkingDisabled,
)
from pagedllm.entrypoints.openai.chat.events import ChatResult
from pagedllm.entrypoints.openai.chat.serving import chat_prompt, generate_chat, prepare_chat
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency, check_model

# Anthropic's error type of each status (a 503 is "overloaded" unless the engine died: ``_error_type``).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}
_ERROR_MEANINGS = {
    400: "invalid_request_error: the request is malformed or breaks a rule; the message names the field",
    401: "authentication_error: missing or wrong API key (x-api-key or Authorization: Bearer; only with --api-key)",
    404: "not_found_error: the request's `model` is not served here",
    503: "overloaded_error while the model loads; api_error once the engine loop died",
}


def _error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": AnthropicErrorResponse, "description": _ERROR_MEANINGS[status]} for status in statuses}


def add_messages_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    app.add_middleware(AnthropicErrors)
    _document_server_rules(app, state)

    @app.post(routes.MESSAGES, response_model=None, responses={
        200: {"model": MessageResponse, "content": sse.stream_content(sse.event_schema("the event as JSON, its `type` the event's", STREAM_EVENTS)),
              "description": "the message (JSON), or with `stream` true Anthropic's events as server-sent events"},
        **_error_responses(400, 401, 404, 503)})
    @cancel_on_disconnect
    async def messages(body: MessagesRequest, request: Request,
                       tenant: str | None = Depends(tenant_of)) -> dict[str, Any] | StreamingResponse:
        chat_body = messages_chat_request(state, body)
        job = prepare_chat(state, chat_body)
        answer = await generate_chat(state, "msg", job, chat_body, tenant)
        if isinstance(answer, ChatResult):
            return message_of(answer, body.model, new_message_id())
        stream = MessageStream(body.model, new_message_id(), len(job.prompt["prompt_token_ids"]))
        return StreamingResponse(message_events(answer, stream), media_type=sse.MEDIA_TYPE)

    @app.post(routes.COUNT_TOKENS, responses={
        200: {"model": CountTokensResponse, "description": "the prompt's tokens as /v1/messages would run it"},
        **_error_responses(400, 401, 404, 503)})
    async def count_tokens(body: MessagesCountTokensRequest,
                           tenant: str | None = Depends(tenant_of)) -> dict[str, int]:
        chat_body = messages_chat_request(state, body)
        check_model(state, chat_body.model)
        return {"input_tokens": len(chat_prompt(state, chat_body)["prompt_token_ids"])}


def _document_server_rules(app: FastAPI, state: ServerState) -> None:
    """Narrow the Messages request schemas of /openapi.json to what this server
    runs, once the engine is loaded: ``thinking`` as ``_check_thinking`` allows
    (``model`` and ``tools`` are ``openapi_doc``'s, as every route's)."""
    documented = app.openapi

    def openapi() -> dict[str, Any]:
        schema = documented()
        if state.async_engine is None:
            return schema
        rules: dict[str, Any] = {}
        variables = state.template_variables()
        if state.reasoning_parser is None:
            rules["thinking"] = {"anyOf": [_ref("ThinkingDisabled"), {"type": "null"}],
                                 "description": "on needs a server started with --reasoning-parser"}
        elif THINKING_SWITCH not in variables:
            rules["thinking"] = {"anyOf": [_ref("ThinkingEnabled"), _ref("ThinkingAdaptive"), {"type": "null"}],
                                 "description": f"the chat template has no {THINKING_SWITCH} switch to turn it off"}
        for name in (MessagesRequest.__name__, MessagesCountTokensRequest.__name__):
            schema["components"]["schemas"][name]["properties"].update(rules)
        return schema

    app.openapi = openapi


def _ref(component: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{component}"}


def messages_chat_request(state: ServerState, body: MessagesCountTokensRequest) -> ChatCompletionRequest:
    """The chat request ``body`` runs as on this server; a 400 for what it cannot run."""
    switch = THINKING_SWITCH in state.template_variables()
    _check_thinking(state, body, switch)
    try:
        return to_chat_request(body, switch)
    except ValueError as exc:
        raise bad_request(exc) from exc


def _check_thinking(state: ServerState, body: MessagesCountTokensRequest, switch: bool) -> None:
    """``thinking`` is honoured or refused, never dropped: on needs a reasoning parser to
    split the thinking out; off needs the template's switch when the model thinks."""
    if body.thinking is None:
        return
    if not isinstance(body.thinking, ThinkingDisabled) and state.reasoning_parser is None:
        raise APIError(400, "thinking: this server does not split thinking from answers; start it with "
                            "--reasoning-parser for a reasoning model, or leave thinking out", param="thinking")
    if isinstance(body.thinking, ThinkingDisabled) and state.reasoning_parser is not None and not switch:
        raise APIError(400, f"thinking: the chat template has no {THINKING_SWITCH} switch, so this model's "
                            "thinking cannot be turned off; leave thinking out", param="thinking")


def is_messages_path(path: str) -> bool:
    return routes.is_under(path, routes.MESSAGES)


def anthropic_error(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body (``errors.error_body``) in Anthropic's shape."""
    try:
        error = json.loads(body)["error"]
        message, code, param = str(error["message"]), error.get("code"), error.get("param")
    except (ValueError, KeyError, TypeError):  # not this server's JSON error: keep its text
        message, code, param = body.decode("utf-8", errors="replace"), None, None
    if param and param not in message:
        message = f"{param}: {message}"
    if status == 503:
        kind = "api_error" if code == "engine_dead" else "overloaded_error"
    else:
        kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


class AnthropicErrors:
    """ASGI middleware: every error answer (status >= 400) of the Messages paths in
    Anthropic's shape; other paths and successful answers (streams too) pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def reshape(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            reshaped = anthropic_error(start["status"], body)
            headers = [(name, value) for name, value in start.get("headers", [])
                       if name.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-length", str(len(reshaped)).encode()), (b"content-type", b"application/json")]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": reshaped})

        await self.app(scope, receive, reshape)

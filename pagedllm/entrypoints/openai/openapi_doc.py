"""The server's OpenAPI document (``/openapi.json``), made to say what the
server does: FastAPI documents a 422 for every request body, but this server
answers a malformed request with a 400 in OpenAI's error shape (each route
documents its error statuses, see ``errors.error_responses``), and the bounds
that come from the engine (``limits``) are written in as maximums."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.entrypoints.openai.limits import bound_schema, document_request_tokens
from pagedllm.entrypoints.openai.state import ServerState

# FastAPI's components for its 422 answers, which this server never gives.
_UNUSED_COMPONENTS = ("HTTPValidationError", "ValidationError")


def install_openapi(app: FastAPI, state: ServerState) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operation in _operations(schema):
            operation["responses"].pop("422", None)
        for name in _UNUSED_COMPONENTS:
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        if state.async_engine is None:
            return schema  # the engine's limits are not known yet: not kept
        bound_schema(state.async_engine.info, schema)
        document_request_tokens(schema, state.request_token_cap)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _operations(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [operation for path in schema.get("paths", {}).values() for operation in path.values()]

"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, and
the handlers that turn every failure of a request into one."""

from __future__ import annotations

import re
from collections.abc import Container

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers, for the OpenAPI document."""

    error: ErrorDetail


# What each error status means, for the OpenAPI document (``error_responses``).
_ERROR_STATUS_MEANINGS = {
    400: "the request is malformed or breaks a rule; `param` names the field to change",
    401: "missing or wrong API key (only when the server runs with --api-key or --api-keys-file)",
    404: "the request's `model` is not served here",
    503: "the model is still loading, or the engine loop died",
}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """FastAPI ``responses=`` for these error statuses, each in OpenAI's error shape."""
    return {status: {"model": ErrorResponse, "description": _ERROR_STATUS_MEANINGS[status]} for status in statuses}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RequestFieldError(ValueError):
    """A bad value in the request field ``param`` (the server's 400 names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def bad_request(exc: ValueError, request_fields: Container[str] = ()) -> APIError:
    """A ValueError from validation becomes a 400 naming the field when it can:
    a ``RequestFieldError``'s field, a ``SamplingParams.<field>`` message's, or
    the request field (one of ``request_fields``) the message starts with."""
    if isinstance(exc, RequestFieldError):
        return APIError(400, str(exc), param=exc.param)
    match = re.match(r"SamplingParams\.(\w+)", str(exc))
    if match:
        return APIError(400, str(exc), param=match.group(1))
    leading = re.match(r"(\w+)", str(exc))
    field = leading.group(1) if leading and leading.group(1) in request_fields else None
    return APIError(400, str(exc), param=field)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"invalid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                                           "invalid_request_error"), status_code=400)
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in errors[:5])
        return JSONResponse(error_body(message or "invalid request", "invalid_request_error",
                                       ".".join(location) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers carries what the status needs, e.g. a 405's Allow (RFC 9110).
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                            headers=exc.headers)

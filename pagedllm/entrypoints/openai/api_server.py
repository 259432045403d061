"""OpenAI-compatible HTTP server: the app assembled over one engine client (the
engine-core process's, or an AsyncLLMEngine in this process).

Each API registers its own routes from its folder: ``chat/`` (POST /v1/chat/completions),
``completions/``, ``responses/`` (OpenAI's Responses API), ``messages/`` (Anthropic's), and
``pooling/`` (a ``--runner pooling`` server's /v1/embeddings, /score, /rerank, /classify, /pooling),
``admin/`` (the server's own routes: /health, /version, /server_info, /metrics, /v1/models,
the block pool; /tokenize and /detokenize; the LoRA admin routes). Every path is in
``common/routes.py``. Here: the lifespan that loads the engine, the refusal while it loads,
the API-key dependency, CORS, and the error shapes (OpenAI's ``{"error": {"message",
"type", "param", "code"}}``; Anthropic's on /v1/messages); /openapi.json documents each
route's statuses and content types (``common/openapi_doc``).
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.version import __version__
from pagedllm.logger import init_logger
from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.engine.client import make_async_engine_client
from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.errors import APIError, error_body, install_error_handlers
from pagedllm.entrypoints.openai.common.openapi_doc import install_openapi
from pagedllm.entrypoints.openai.common.reasoning import ReasoningSettings
from pagedllm.entrypoints.openai.chat.serving import add_chat_route
from pagedllm.entrypoints.openai.completions.serving import add_completion_route
from pagedllm.entrypoints.openai.admin.lora import add_lora_routes
from pagedllm.entrypoints.openai.admin.server import add_server_routes
from pagedllm.entrypoints.openai.admin.tokens import add_token_routes
from pagedllm.entrypoints.openai.messages.serving import add_messages_routes
from pagedllm.entrypoints.openai.pooling.serving import add_pooling_routes, runner_guard
from pagedllm.entrypoints.openai.responses.serving import add_responses_routes
from pagedllm.entrypoints.openai.common.state import (ServerState, TenantDependency, presented_key,
                                               tenant_of_key)

__all__ = ["ServerState", "build_app"]

logger = init_logger(__name__)


# Routes that work without an engine (probes); the rest answer 503 while the model loads.
_ANSWERED_WHILE_LOADING = frozenset({routes.HEALTH, routes.VERSION})


def build_app(state: ServerState, allowed_origins: list[str] | None = None) -> FastAPI:
    """The app over ``state.async_engine``. ``allowed_origins``: the browser origins
    CORS lets call the API (``["*"]``: any); None sends no CORS headers, so
    browsers keep other sites' pages from reading responses."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = None
        if state.async_engine is None:
            loading = asyncio.create_task(_load_engine(state))
        else:
            state.async_engine.start()
        yield
        if loading is not None and not loading.done():
            # Stop waiting for a core that is still loading (with N API servers one that never
            # loads is waited for until now). An engine being built in a thread cannot be
            # interrupted: the interpreter joins that thread at exit.
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
        if state.async_engine is not None:
            await state.async_engine.stop()

    if state.async_engine is not None:
        state.reasoning  # noqa: B018 - a --reasoning-parser that does not fit the model fails here
    tenant_of = _tenant_dependency(state)
    # A generation route on a pooling server, or a pooling route on a generation server: a 400 saying
    # which --runner to start it with (before the body is read).
    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan,
                  dependencies=[Depends(runner_guard(state, tenant_of))])
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app)
    install_openapi(app, state)

    app.add_middleware(RefuseWhileLoading, state=state)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "server_error", code="engine_dead"), status_code=503)

    add_server_routes(app, state, tenant_of)
    add_token_routes(app, state, tenant_of)
    add_completion_route(app, state, tenant_of)
    add_chat_route(app, state, tenant_of)
    add_messages_routes(app, state, tenant_of)
    add_responses_routes(app, state, tenant_of)
    add_pooling_routes(app, state, tenant_of)
    if state.adapters is not None:
        add_lora_routes(app, state, tenant_of)
    return app


async def _load_engine(state: ServerState) -> None:
    """Build the engine in a thread (the event loop keeps answering /health), or
    start the client of an engine-core process and wait until the core is
    ready; then serve. A failed load is kept for /health and logged."""
    client = None
    try:
        client = make_async_engine_client(await asyncio.to_thread(state.load_engine))
        client.start()
        await client.wait_ready()
        if state.reasoning_parser is not None:  # a parser that does not fit the model stops the server
            ReasoningSettings.for_tokenizer(state.reasoning_parser, client.info.tokenizer)
        if state.adapters is not None:  # checked before anything is served: a bad one stops the server
            await state.adapters.load_startup(client, state.model_names)
    except asyncio.CancelledError:  # the server stops while the core loads
        if client is not None:
            await client.stop()
        raise
    except Exception as exc:
        state.load_error = exc
        logger.exception("loading the model failed")
        if client is not None:
            await client.stop()
        if state.on_load_failure is not None:
            state.on_load_failure()
        return
    state.async_engine = client


class RefuseWhileLoading:
    """ASGI middleware: a 503 for every route but the probes until the engine is loaded.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's
    BaseHTTPMiddleware passes every chunk of a streamed answer through a memory
    stream and a task of its own, CPU per token that an engine on the same
    cores pays for (the API process's profile under load)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.state.async_engine is None \
                and scope["path"] not in _ANSWERED_WHILE_LOADING:
            refusal = JSONResponse(error_body(self.state.not_ready_reason(), "server_error", code="model_loading"),
                                   status_code=503)
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _tenant_dependency(state: ServerState) -> TenantDependency:
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop per request
    async def tenant_of(request: Request) -> str | None:
        """Bearer-token check; returns the key's tenant (None when untenanted)."""
        if not state.api_keys:
            return None
        matched, tenant = tenant_of_key(state.api_keys, presented_key(request))
        if not matched:
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return tenant

    return tenant_of

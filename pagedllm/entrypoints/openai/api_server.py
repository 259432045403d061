"""OpenAI-compatible HTTP server: FastAPI + uvicorn over one AsyncLLMEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE
streaming), GET /v1/models, GET /health, POST /tokenize, POST /detokenize,
POST /reset_prefix_cache, GET /metrics (Prometheus). Errors use OpenAI's JSON
shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.metrics import EngineMetrics
from pagedllm.entrypoints.openai.responses import ResponseBuilder
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(exc: ValueError) -> APIError:
    """A ValueError from validation becomes a 400 naming the field when it can."""
    match = re.match(r"SamplingParams\.(\w+)", str(exc))
    return APIError(400, str(exc), param=match.group(1) if match else None)


_DASHBOARD = Path(__file__).parent / "static" / "dashboard.html"

@dataclass
class ServerState:
    engine: LLMEngine
    served_model_name: str
    # API key -> tenant name (None: a key without a tenant). Empty: no auth.
    api_keys: dict[str, str | None] = field(default_factory=dict)
    async_engine: AsyncLLMEngine | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine = AsyncLLMEngine(
            state.engine, on_step=lambda outputs: state.metrics.update(state.engine.stats(), outputs)
        )
        state.async_engine.start()
        state.metrics.update(state.engine.stats(), [])
        yield
        await state.async_engine.stop()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    _install_error_handlers(app)
    tenant_of = _tenant_dependency(state)
    _add_pool_routes(app, state, tenant_of)
    _add_token_routes(app, state, tenant_of)
    _add_generation_routes(app, state, tenant_of)
    return app


TenantDependency = Callable[[Request], str | None]  # the bearer-token check; returns the tenant


def _tenant_dependency(state: ServerState) -> TenantDependency:
    def tenant_of(request: Request) -> str | None:
        """Bearer-token check; returns the key's tenant (None when untenanted)."""
        if not state.api_keys:
            return None
        header = request.headers.get("authorization", "")
        key = header[7:] if header.lower().startswith("bearer ") else None
        if key is None or key not in state.api_keys:
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return state.api_keys[key]

    return tenant_of


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.served_model_name!r}",
                       code="model_not_found", param="model")


def _add_pool_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    """Health, metrics, the model list and the block pool (its page, its JSON, its reset)."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(tenant: str | None = Depends(tenant_of)) -> dict:
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": 0, "owned_by": "pagedllm",
            "max_model_len": state.engine.max_model_len,
        }]}

    @app.get("/dashboard")
    async def dashboard(request: Request) -> Response:
        """The live block-pool page. Under --api-key the key comes as ``?key=``
        (a browser cannot set the header on a page load); the page sends it on."""
        if state.api_keys and request.query_params.get("key") not in state.api_keys:
            raise APIError(401, "invalid or missing API key: open /dashboard?key=YOUR_KEY", "authentication_error",
                           code="invalid_api_key")
        return HTMLResponse(_DASHBOARD.read_text(encoding="utf-8"))

    @app.get("/v1/kv_pool")
    async def kv_pool(tenant: str | None = Depends(tenant_of)) -> dict:
        """The live block pool (see ``LLM.kv_pool_snapshot``)."""
        return state.engine.kv_pool_snapshot()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(tenant: str | None = Depends(tenant_of)) -> dict:
        return {"dropped_blocks": state.engine.reset_prefix_cache()}


def _add_token_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        _check_model(state, body.model)
        tokenizer = state.engine.get_tokenizer()
        if body.messages is not None:
            ids = _chat_prompt(state.engine, body.messages, True)["prompt_token_ids"]
        elif body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "pass either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        _check_model(state, body.model)
        vocab = state.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": state.engine.get_tokenizer().decode(body.tokens)}


def _add_generation_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, tenant: str | None = Depends(tenant_of)):
        _check_model(state, body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompts = _completion_prompts(body.prompt)
        try:
            params = body.sampling_params(body.max_tokens, body.logprobs)
        except ValueError as exc:
            raise bad_request(exc) from exc
        return await _serve(state, "cmpl", prompts, params, body, tenant, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, tenant: str | None = Depends(tenant_of)):
        _check_model(state, body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            prompt = _chat_prompt(state.engine, body.messages, body.add_generation_prompt)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = body.sampling_params(body.max_completion_tokens or body.max_tokens, logprobs)
        except ValueError as exc:
            raise bad_request(exc) from exc
        return await _serve(state, "chatcmpl", [prompt], params, body, tenant, chat=True)


def _install_error_handlers(app: FastAPI) -> None:
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
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def _chat_prompt(engine: LLMEngine, messages, add_generation_prompt: bool) -> dict:
    tokenizer = engine.get_tokenizer()
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template", param="messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


async def _serve(state: ServerState, kind: str, prompts: list[PromptType], params: SamplingParams,
                 body, tenant: str | None, chat: bool):
    # A tenant's salt is applied server-side and overrides the client's, so no
    # client can pick another tenant's prefix-cache blocks.
    salt = f"tenant:{tenant}" if tenant is not None else body.cache_salt
    engine = state.async_engine
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            rid = engine.next_request_id(kind)
            streams.append(await engine.add_request(rid, prompt, params, priority=body.priority, cache_salt=salt))
    except ValueError as exc:
        for stream in streams:
            stream.abort()
        raise bad_request(exc) from exc
    response = ResponseBuilder(state.engine.get_tokenizer(), kind, params, chat, body.model or state.served_model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(response, streams, include_usage), media_type="text/event-stream")
    try:
        finals = await asyncio.gather(*(_last(stream) for stream in streams))
    finally:
        for stream in streams:
            stream.abort()
    return response.full(finals)


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


async def _stream(response: ResponseBuilder, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
    """SSE events of every prompt's outputs as they come; aborts everything left
    if the client goes away (the generator is cancelled or closed)."""
    merged: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for output in stream:
            await merged.put((index, output))
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    finals: dict[int, RequestOutput] = {}
    try:
        remaining = len(streams)
        while remaining:
            index, output = await merged.get()
            if output is None:
                remaining -= 1
                continue
            for chunk in response.chunks(index, output, include_usage):
                yield f"data: {json.dumps(chunk)}\n\n"
            if output.finished:
                finals[index] = output
        for task in tasks:
            task.result()  # re-raise an engine failure
        if include_usage:
            yield f"data: {json.dumps(response.usage_chunk([finals[i] for i in sorted(finals)]))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()

"""The server's own routes: GET /health (503 while the model loads, until the engine
loop runs, after it died), /version, /server_info (what a fleet router reads), /metrics
(Prometheus), /v1/models, the block pool (/dashboard, /v1/kv_pool) and POST
/reset_prefix_cache."""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.errors import APIError, error_responses
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency, tenant_of_key
from pagedllm.version import __version__

_DASHBOARD = Path(__file__).parents[1] / "static" / "dashboard.html"


def add_server_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    """Health, version, metrics, the model list and the block pool (its page, its JSON, its reset)."""

    @app.get(routes.HEALTH, responses=error_responses(503))
    async def health() -> dict[str, str]:
        if not state.is_ready:
            raise APIError(503, state.not_ready_reason(), "server_error", code="engine_not_ready")
        return {"status": "ok"}

    @app.get(routes.VERSION)
    async def version() -> dict:
        return {"version": __version__}

    @app.get(routes.SERVER_INFO)
    async def server_info() -> dict:
        """What a fleet router needs to hash prompts as this server does and to follow its cache."""
        from pagedllm.entrypoints.router.request_prefix import prompt_fingerprint

        return {"model": state.served_model_name, "model_names": state.model_names, "version": __version__,
                "lora_adapters": dict(state.adapters.fingerprints) if state.adapters is not None else {},
                **state.engine_settings,
                "prompt_fingerprint": prompt_fingerprint(state.engine_info.tokenizer, state.chat.chat_template)}

    @app.get(routes.METRICS, response_class=PlainTextResponse, responses=error_responses(503),
             description="Prometheus text exposition format")
    async def metrics() -> Response:
        try:
            text = await state.async_engine.metrics_text()
        except TimeoutError:  # (asyncio's is the builtin since 3.11)
            raise APIError(503, "the engine core did not answer for its metrics within 10 s", "server_error",
                           code="engine_busy") from None
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get(routes.MODELS, responses=error_responses(401, 503))
    async def models(tenant: str | None = Depends(tenant_of)) -> dict:
        return {"object": "list", "data": _model_cards(state)}

    @app.get(routes.DASHBOARD, response_class=HTMLResponse, responses=error_responses(401, 503))
    async def dashboard(request: Request) -> Response:
        """The live block-pool page. Under --api-key the key comes as ``?key=``
        (a browser cannot set the header on a page load); the page sends it on."""
        if state.api_keys and not tenant_of_key(state.api_keys, request.query_params.get("key"))[0]:
            raise APIError(401, "invalid or missing API key: open /dashboard?key=YOUR_KEY", "authentication_error",
                           code="invalid_api_key")
        return HTMLResponse(_DASHBOARD.read_text(encoding="utf-8"))

    @app.get(routes.KV_POOL, responses=error_responses(401, 503))
    async def kv_pool(tenant: str | None = Depends(tenant_of)) -> dict:
        """The live block pool (see ``LLM.kv_pool_snapshot``), between two steps."""
        return await state.async_engine.kv_pool_snapshot()

    @app.post(routes.RESET_PREFIX_CACHE, responses=error_responses(401, 503))
    async def reset_prefix_cache(tenant: str | None = Depends(tenant_of)) -> dict:
        return {"dropped_blocks": await state.async_engine.reset_prefix_cache()}


def _model_cards(state: ServerState) -> list[dict]:
    """The base model's names, then the LoRA adapters (vLLM's shape: ``root`` a path, ``parent`` the base)."""
    max_model_len = state.engine_info.max_model_len
    base = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedllm",
             "root": state.model_root or state.served_model_name, "parent": None, "max_model_len": max_model_len}
            for name in state.model_names]
    adapters = state.adapters.model_cards(state.served_model_name, max_model_len) if state.adapters is not None else []
    return base + adapters

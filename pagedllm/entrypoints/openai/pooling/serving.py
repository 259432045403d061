"""The pooling routes: OpenAI's POST /v1/embeddings, vLLM's /score and /v1/score,
/rerank and /v1/rerank (Jina's shape), /v2/rerank (Cohere's), /classify and
/pooling. Each builds its inputs with the offline API's code path and runs them
on the server's ``PoolingService``; a generation server answers them with a 400
saying to start it with ``--runner pooling`` (``runner_guard``)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import torch
from fastapi import Depends, FastAPI, Request

from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.errors import APIError, error_responses
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency, cache_salt_of, check_model
from pagedllm.entrypoints.openai.pooling.protocol import (ClassifyRequest, EmbeddingRequest, PoolingRequest,
                                                           PoolingRequestBase, RerankRequest, ScoreRequest)
from pagedllm.entrypoints.openai.pooling.service import START_POOLING, class_labels, pooling_service, prompt_list
from pagedllm.entrypoints.pooling_api import PooledResult
from pagedllm.entrypoints.pooling_inputs import PooledPrompt
from pagedllm.pooling_params import PoolingParams

_RESPONSES = error_responses(400, 401, 404, 503)
# The request fields an input error may name (its 400's ``param``).
_NAMED_FIELDS = ("truncate_prompt_tokens", "prompt_name")


def add_pooling_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post(routes.EMBEDDINGS, responses=_RESPONSES)
    async def embeddings(body: EmbeddingRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        inputs, results = await _run(state, body, tenant, lambda b: b.inputs.prompts(
            prompt_list(body.input), params, "embed", body.truncate_prompt_tokens, body.prompt_name))
        data = [{"object": "embedding", "index": i, "embedding": _encoded(r.data, body.encoding_format)}
                for i, r in enumerate(results)]
        return {"object": "list", "data": data, "model": _model(state, body), "usage": _usage(inputs, results)}

    async def score(body: ScoreRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        inputs, results = await _run(state, body, tenant, lambda b: b.inputs.pairs(
            body.text_1, body.text_2, PoolingParams(use_activation=body.activation), body.truncate_prompt_tokens))
        data = [{"index": i, "object": "score", "score": float(r.data[0])} for i, r in enumerate(results)]
        return {**_head(state, body, "score"), "data": data, "usage": _usage(inputs, results)}

    async def rerank(body: RerankRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        return await _rerank(state, body, tenant, cohere=False)

    async def rerank_v2(body: RerankRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        return await _rerank(state, body, tenant, cohere=True)

    @app.post(routes.CLASSIFY, responses=_RESPONSES)
    async def classify(body: ClassifyRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        inputs, results = await _run(state, body, tenant, lambda b: b.inputs.prompts(
            prompt_list(body.input), PoolingParams(use_activation=body.activation), "classify",
            body.truncate_prompt_tokens))
        labels = class_labels(state, len(results[0].data)) if results else []
        data = [{"index": i, "label": labels[int(torch.argmax(r.data))], "probs": r.data.tolist(),
                 "num_classes": len(labels)} for i, r in enumerate(results)]
        return {**_head(state, body, "classify"), "data": data, "usage": _usage(inputs, results)}

    @app.post(routes.POOLING, responses=_RESPONSES)
    async def pooling(body: PoolingRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        inputs, results = await _run(state, body, tenant, lambda b: b.inputs.prompts(
            prompt_list(body.input), None, body.task, body.truncate_prompt_tokens))
        data = [{"index": i, "object": "pooling", "data": _encoded(r.data, body.encoding_format)}
                for i, r in enumerate(results)]
        return {**_head(state, body, "pool"), "data": data, "usage": _usage(inputs, results)}

    for path in (routes.SCORE, routes.V1_SCORE):
        app.post(path, responses=_RESPONSES)(score)
    for path in (routes.RERANK, routes.V1_RERANK):
        app.post(path, responses=_RESPONSES)(rerank)
    app.post(routes.V2_RERANK, responses=_RESPONSES)(rerank_v2)


def runner_guard(state: ServerState, tenant_of: TenantDependency) -> Any:
    """The app's dependency that answers a route of the other runner with a 400 (after the key check)."""

    async def guard(request: Request) -> None:
        needs = routes.RUNNER_OF_PATH.get(getattr(request.scope.get("route"), "path", ""))
        if needs is None or state.async_engine is None:
            return
        await tenant_of(request)
        pools = state.engine_info.pooler_spec is not None
        if needs == "generate" and pools:
            raise APIError(400, "this server pools (--runner pooling): it serves /v1/embeddings, /score, /rerank, "
                                "/classify and /pooling; start the server without --runner pooling to generate text")
        if needs == "pooling" and not pools:
            raise APIError(400, f"this server generates text; {START_POOLING} to serve {request.url.path} "
                                "(with an embedding, reranker or classifier model)")

    return guard


async def _run(state: ServerState, body: PoolingRequestBase, tenant: str | None,
               build: Any) -> tuple[list[PooledPrompt], list[PooledResult]]:
    """The request's inputs (``build`` of the service) and their results; a 400 for a bad input."""
    if check_model(state, body.model) is not None:
        raise APIError(400, "the pooling routes serve the base model; name it (or no model), not an adapter",
                       param="model")
    service = pooling_service(state)
    try:
        inputs = build(service)
    except ValueError as exc:
        param = next((name for name in _NAMED_FIELDS if name in str(exc)), None)
        raise APIError(400, str(exc), param=param) from exc
    return inputs, await service.run(inputs, cache_salt_of(tenant, body.cache_salt))


async def _rerank(state: ServerState, body: RerankRequest, tenant: str | None, cohere: bool) -> dict:
    inputs, results = await _run(state, body, tenant, lambda b: b.inputs.pairs(
        body.query, body.documents, None, body.truncate_prompt_tokens))
    ranked = sorted(range(len(results)), key=lambda i: -float(results[i].data[0]))
    ranked = ranked[:body.top_n] if body.top_n else ranked
    answers = [{"index": i, "relevance_score": float(results[i].data[0]),
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in ranked]
    if cohere:
        return {"id": _head(state, body, "rerank")["id"], "results": answers,
                "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}}
    return {"id": _head(state, body, "rerank")["id"], "model": _model(state, body), "usage": _usage(inputs, results),
            "results": answers}


def _encoded(data: torch.Tensor, encoding_format: str) -> Any:
    """Numbers as JSON, or base64 of their little-endian float32 bytes (how the openai client decodes it)."""
    if encoding_format == "base64":
        return base64.b64encode(data.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
    return data.tolist()


def _model(state: ServerState, body: PoolingRequestBase) -> str:
    return body.model or state.served_model_name


def _head(state: ServerState, body: PoolingRequestBase, kind: str) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": _model(state, body)}


def _usage(inputs: list[PooledPrompt], results: list[PooledResult]) -> dict:
    """OpenAI's usage, and the prompt tokens whose K/V came from the prefix cache (a decoder's: the query
    of a rerank's later documents)."""
    tokens = sum(len(item.token_ids) for item in inputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in results)}}

"""POST /v1/completions."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving import serve
from pagedllm.entrypoints.openai.structured_outputs import check_structured_outputs, request_error
from pagedllm.entrypoints.openai.state import ServerState, TenantDependency, check_model


def add_completion_route(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, tenant: str | None = Depends(tenant_of)):
        check_model(state, body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompts = completion_prompts(body.prompt)
        try:
            params = body.sampling_params(body.max_tokens, body.logprobs)
            check_structured_outputs(state.engine, body, params)
        except ValueError as exc:
            raise request_error(exc) from exc
        return await serve(state, "cmpl", prompts, params, body, tenant, chat=False)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]

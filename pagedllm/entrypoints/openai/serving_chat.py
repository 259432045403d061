"""POST /v1/chat/completions, and the chat template that turns messages into a prompt."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving import serve
from pagedllm.entrypoints.openai.structured_outputs import check_structured_outputs, request_error
from pagedllm.entrypoints.openai.state import ServerState, TenantDependency, check_model


def add_chat_route(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, tenant: str | None = Depends(tenant_of)):
        check_model(state, body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            prompt = chat_prompt(state.engine, body.messages, body.add_generation_prompt)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = body.sampling_params(body.max_completion_tokens or body.max_tokens, logprobs)
            check_structured_outputs(state.engine, body, params)
        except ValueError as exc:
            raise request_error(exc) from exc
        return await serve(state, "chatcmpl", [prompt], params, body, tenant, chat=True)


def chat_prompt(engine: LLMEngine, messages, add_generation_prompt: bool) -> dict:
    tokenizer = engine.get_tokenizer()
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template", param="messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

"""POST /tokenize and POST /detokenize: the tokens a prompt (or a chat's messages,
rendered as chat completions renders them) runs as, and the text of tokens."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from pagedllm.entrypoints.openai.chat.serving import chat_prompt
from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.errors import APIError, error_responses
from pagedllm.entrypoints.openai.common.limits import check_limits
from pagedllm.entrypoints.openai.common.protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency, check_model


def add_token_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post(routes.TOKENIZE, responses=error_responses(400, 401, 404, 503))
    async def tokenize(body: TokenizeRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        check_model(state, body.model)
        tokenizer = state.engine_info.tokenizer
        if body.messages is not None:
            ids = chat_prompt(state, body)["prompt_token_ids"]
        elif body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "pass either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine_info.max_model_len}

    @app.post(routes.DETOKENIZE, responses=error_responses(400, 401, 404, 503))
    async def detokenize(body: DetokenizeRequest, tenant: str | None = Depends(tenant_of)) -> dict:
        check_model(state, body.model)
        check_limits(state.engine_info, body)
        return {"prompt": state.engine_info.tokenizer.decode(body.tokens)}


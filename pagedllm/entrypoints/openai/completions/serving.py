"""POST /v1/completions."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import Depends, FastAPI, Request

from pagedllm.core.prompt_tokens import tokenized
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.common.disconnect import cancel_on_disconnect
from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.completions.bodies import CompletionBodies
from pagedllm.entrypoints.openai.completions.choices import CompletionOptions
from pagedllm.entrypoints.openai.common.errors import APIError, bad_request, error_body
from pagedllm.entrypoints.openai.common.limits import check_limits, check_request_tokens
from pagedllm.entrypoints.openai.common.protocol import CompletionRequest
from pagedllm.entrypoints.openai.common.generation import (GENERATION_RESPONSES, add_prompts, finals, sse_response,
                                                            stream_events)
from pagedllm.entrypoints.openai.common.structured_outputs import check_structured_outputs
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency, check_model
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

# Fill-in-the-middle tokens (prefix, suffix, middle), in the spellings models use:
# StarCoder / SantaCoder, then Qwen2.5-Coder and its kin.
FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def add_completion_route(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post(routes.COMPLETIONS, responses=GENERATION_RESPONSES)
    @cancel_on_disconnect
    async def completions(body: CompletionRequest, request: Request, tenant: str | None = Depends(tenant_of)):
        lora_request = check_model(state, body.model)
        check_limits(state.engine_info, body)
        echo_only = body.max_tokens == 0
        if echo_only and not body.echo:
            raise APIError(400, "max_tokens 0 is only allowed with echo=true (it returns the prompt alone); "
                                "ask for at least 1 token", param="max_tokens")
        prompts = completion_prompts(body.prompt)
        if body.suffix is not None:
            if body.echo:
                raise APIError(400, "suffix cannot be used with echo", param="suffix")
            prompts = [fill_in_the_middle(state.engine_info.tokenizer, p, body.suffix) for p in prompts]
        # With echo, the prompt's tokens get the same logprobs as the generated ones (vLLM).
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = body.logprobs
        try:
            # max_tokens 0: the engine runs the prefill and samples one token, which the response drops.
            params = body.sampling_params(1 if echo_only else body.max_tokens, body.logprobs, prompt_logprobs,
                                          defaults=state.engine_info.default_sampling_params)
            check_structured_outputs(state.async_engine, body, params)
        except ValueError as exc:
            raise bad_request(exc, CompletionRequest.model_fields) from exc
        # Tokenized here (as the engine would), so the request's work is known before it is queued.
        prompts = [tokenized(state.engine_info.tokenizer, prompt) for prompt in prompts]
        check_request_tokens(state.engine_info, state.request_token_cap,
                             [len(prompt["prompt_token_ids"]) for prompt in prompts], params)
        options = CompletionOptions(echo=body.echo, echo_only=echo_only, prompt_logprobs=body.prompt_logprobs is not None,
                                    tokens_as_ids=body.return_tokens_as_token_ids)
        return await _answer(state, prompts, params, body, tenant, options, lora_request)


async def _answer(state: ServerState, prompts: list[PromptType], params: SamplingParams, body: CompletionRequest,
                  tenant: str | None, options: CompletionOptions, lora_request: LoRARequest | None) -> Any:
    """The whole ``text_completion``, or its chunks as SSE events."""
    streams = await add_prompts(state, "cmpl", prompts, params, body, tenant, lora_request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    bodies = CompletionBodies(state.engine_info.tokenizer, params, body.model or state.served_model_name, options,
                              include_usage)
    if not body.stream:
        return bodies.full(await finals(streams))
    failure = partial(error_body, type_="server_error", code="engine_dead")
    return sse_response(stream_events(streams, bodies.chunks, bodies.usage_chunk, failure), lambda chunk: chunk)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def fim_token_names(tokenizer: Any) -> tuple[str, str, str] | None:
    """The tokenizer's fill-in-the-middle tokens (prefix, suffix, middle), or None: it has none."""
    vocab = tokenizer.get_vocab()
    return next((triple for triple in FIM_TOKENS if all(name in vocab for name in triple)), None)


def fill_in_the_middle(tokenizer: Any, prompt: PromptType, suffix: str) -> dict:
    """``<fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>`` as token ids (the
    model then writes the middle); a 400 naming ``suffix`` when the tokenizer has
    no fill-in-the-middle tokens."""
    names = fim_token_names(tokenizer)
    if names is None:
        raise APIError(400, "suffix needs a model with fill-in-the-middle tokens "
                            f"({' / '.join(' '.join(t) for t in FIM_TOKENS)}); this one has none", param="suffix")
    prefix_id, suffix_id, middle_id = tokenizer.convert_tokens_to_ids(list(names))
    if isinstance(prompt, str):
        prompt_ids, text = tokenizer.encode(prompt, add_special_tokens=False), prompt
    else:
        prompt_ids, text = prompt["prompt_token_ids"], None
    token_ids = [prefix_id, *prompt_ids, suffix_id, *tokenizer.encode(suffix, add_special_tokens=False), middle_id]
    return {"prompt": None if text is None else f"{names[0]}{text}{names[1]}{suffix}{names[2]}",
            "prompt_token_ids": token_ids}

"""POST /v1/chat/completions: messages rendered by the chat template (shared with
``LLM.chat``, see ``chat_utils``), tools and ``tool_choice``, and the answer."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request

from pagedllm.entrypoints.chat_utils import ChatRenderOptions, render_chat
from pagedllm.entrypoints.openai.common.disconnect import cancel_on_disconnect
from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.chat.choices import ChatChoices
from pagedllm.entrypoints.openai.chat.encoder import ChatEncoder
from pagedllm.entrypoints.openai.chat.events import ChatEvent, ChatResult, EngineFailure
from pagedllm.entrypoints.openai.chat.output import ChatOutput
from pagedllm.entrypoints.openai.common.errors import APIError, bad_request
from pagedllm.entrypoints.openai.common.limits import check_limits, check_request_tokens
from pagedllm.entrypoints.openai.common.protocol import (
    ChatCompletionRequest, NamedToolChoice, TokenizeRequest,
)
from pagedllm.entrypoints.openai.common.reasoning import ReasoningSplitter
from pagedllm.entrypoints.openai.common.generation import (GENERATION_RESPONSES, add_prompts, finals, sse_response,
                                                            stream_events)
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.common.structured_outputs import check_structured_outputs
from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency, check_model
from pagedllm.entrypoints.openai.tool_parsers import ToolPlan, plan_tool_choice
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputError


@dataclass(frozen=True)
class ChatJob:
    """A chat request made ready to run: its prompt, sampling params (a tool
    choice's or schema's grammar behind the thinking), and how to read the output."""

    prompt: dict
    params: SamplingParams
    output: ChatOutput
    lora_request: LoRARequest | None


def add_chat_route(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    @app.post(routes.CHAT, responses=GENERATION_RESPONSES)
    @cancel_on_disconnect
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               tenant: str | None = Depends(tenant_of)):
        job = prepare_chat(state, body)
        # made before the run, so that "created" is when the request came
        encoder = ChatEncoder(state.engine_info.tokenizer, "chatcmpl", job.params.logprobs,
                              body.model or state.served_model_name, _includes_usage(body))
        answer = await generate_chat(state, "chatcmpl", job, body, tenant)
        if isinstance(answer, ChatResult):
            return encoder.body(answer)
        return sse_response(answer, encoder.chunk)


async def generate_chat(state: ServerState, kind: str, job: ChatJob, body: ChatCompletionRequest,
                        tenant: str | None) -> ChatResult | AsyncIterator[ChatEvent]:
    """Run a prepared chat request: the whole answer, or (``body.stream``) its
    events, the usage last when ``stream_options.include_usage`` asks. The one run
    of chat completions, the Responses API and the Messages API (``kind`` prefixes
    the engine's request ids)."""
    streams = await add_prompts(state, kind, [job.prompt], job.params, body, tenant, job.lora_request)
    choices = ChatChoices(job.params, job.output)
    if not body.stream:
        return choices.result(await finals(streams))
    usage = _includes_usage(body)
    return stream_events(streams, choices.deltas, lambda last: [Usage.of(last)] if usage else [], EngineFailure)


def _includes_usage(body: ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> ChatJob:
    """Checks, renders and plans one chat request: the one path of chat completions,
    the Responses API and the Messages API. Raises ``APIError`` (400 naming the field, 404 for the model)."""
    lora_request = check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    check_limits(state.engine_info, body)
    try:
        prompt = chat_prompt(state, body)
        tools = _tools(body)
        choice = body.tool_choice
        plan = plan_tool_choice(tools, choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
                                body.parallel_tool_calls)
        top_logprobs = 0 if body.top_logprobs is None else body.top_logprobs
        # max_completion_tokens (OpenAI's newer name) wins; "is None", since a 0 must not fall through
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        params = body.sampling_params(max_tokens, top_logprobs if body.logprobs else None,
                                      defaults=state.engine_info.default_sampling_params)
        check_structured_outputs(state.async_engine, body, params)
        params = _with_tool_grammar(state, params, plan)
    except ValueError as exc:
        raise bad_request(exc, ChatCompletionRequest.model_fields) from exc
    check_request_tokens(state.engine_info, state.request_token_cap, [len(prompt["prompt_token_ids"])], params,
                         "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens")
    reasoning = state.reasoning
    if reasoning is None:
        return ChatJob(prompt, params, ChatOutput(plan.new_parser), lora_request)
    starts_thinking = reasoning.starts_thinking(prompt["prompt"])
    if params.structured_outputs is not None:
        gated = dataclasses.replace(params.structured_outputs, reasoning=reasoning.gate(starts_thinking))
        params = dataclasses.replace(params, structured_outputs=gated)
    output = ChatOutput(plan.new_parser, lambda: ReasoningSplitter(starts_thinking),
                        show_reasoning=body.include_reasoning)
    return ChatJob(prompt, params, output, lora_request)


def _with_tool_grammar(state: ServerState, params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """``params`` constrained as a required or named tool choice needs, compiled
    now so a tool's bad ``parameters`` schema is a 400 naming ``tools``."""
    if plan.structured_outputs is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError("tool_choice: a required or named tool choice constrains the output itself; "
                         "it cannot be combined with response_format or structured outputs")
    params = dataclasses.replace(params, structured_outputs=plan.structured_outputs)
    try:
        state.async_engine.compile_structured_outputs(params)
    except StructuredOutputError as exc:
        raise ValueError(f"tools: a function's parameters schema is invalid: {exc.reason}") from exc
    return params


def _tools(body: ChatCompletionRequest | TokenizeRequest) -> list[dict] | None:
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None


def render_inputs(body: ChatCompletionRequest | TokenizeRequest,
                  server_template: str | None) -> tuple[list[dict], ChatRenderOptions]:
    """The conversation and render options of a chat request, for ``render_chat``
    (the request's template, when it sends one, else ``server_template``): shared
    with the fleet router, which must render prompts exactly as replicas do."""
    options = ChatRenderOptions(
        tools=_tools(body), add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template or server_template, chat_template_kwargs=body.chat_template_kwargs,
    )
    return [message.model_dump(exclude_none=True) for message in body.messages], options


def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> dict:
    """The prompt of a chat request's messages and template fields, rendered with
    the server's chat template (/tokenize gives the same tokens). Raises
    ``APIError`` 400 naming the field to change."""
    if body.chat_template is not None and not state.chat.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not run templates sent in requests; start it with "
                            "--trust-request-chat-template, or use its own (--chat-template)", param="chat_template")
    conversation, options = render_inputs(body, state.chat.chat_template)
    try:
        return render_chat(state.engine_info.tokenizer, conversation, options, state.engine_info.multimodal)
    except ValueError as exc:
        raise bad_request(exc, ChatCompletionRequest.model_fields) from exc

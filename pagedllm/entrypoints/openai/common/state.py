"""What every route of the server shares: the async engine, the served names, the keys."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pagedllm.engine.client import AsyncEngineClient, CoreConnection
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.entrypoints.chat_utils import ChatSettings, template_variables
from pagedllm.entrypoints.openai.common.errors import APIError
from pagedllm.entrypoints.openai.common.reasoning import ReasoningSettings
from pagedllm.entrypoints.openai.responses.store import ResponseStore

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.admin.lora import ServedAdapters
    from pagedllm.lora.request import LoRARequest


@dataclass
class ServerState:
    """Safety rules: routes reach the engine only through ``async_engine``, an
    ``AsyncEngineClient`` (``engine/client.py``: its ``info`` for the fixed facts,
    its methods for anything that reads or changes the scheduler or the pool),
    never an ``LLMEngine`` under it, whose step runs in another thread. ``async_engine`` is None only while
    ``load_engine`` runs; the app's middleware answers every route but /health
    and /version with a 503 until then, so a route never sees None."""

    served_model_name: str  # the first name: reported when a request names no model
    # API key -> tenant name (None: a key without a tenant). Empty: no auth.
    api_keys: dict[str, str | None] = field(default_factory=dict)
    async_engine: AsyncEngineClient | None = None
    chat: ChatSettings = field(default_factory=ChatSettings)  # --chat-template, --trust-request-chat-template
    # Further names a request's "model" may use (--served-model-name A B C: B and C).
    model_aliases: list[str] = field(default_factory=list)
    # Builds the engine when ``async_engine`` is not given: called in a thread once
    # the server listens, so /health answers 503 (not "connection refused") while
    # the model loads. ``make_async_engine_client`` makes the client of what it returns:
    # an ``LLMEngine``, or the ``CoreConnection`` of a core process (served once the core is ready).
    load_engine: Callable[[], LLMEngine | CoreConnection] | None = None
    load_error: BaseException | None = None
    # Called on the event loop once a failed load is logged (`pagedllm serve` stops with
    # status 1); None keeps the server up, answering /health with the error.
    on_load_failure: Callable[[], None] | None = None
    # What a fleet router reads from GET /server_info: the engine's block size and
    # KV-events sockets as configured (``{"block_size": 16, "kv_events": {...} | None}``).
    engine_settings: dict[str, Any] = field(default_factory=dict)
    # The LoRA adapters served by name (--enable-lora; their --lora-modules load before serving). None: no LoRA.
    adapters: ServedAdapters | None = None
    # The base model's path, /v1/models' "root" (None: the first served name).
    model_root: str | None = None
    # --max-tokens-per-request: the most tokens one request may make the engine compute
    # (``limits.request_tokens``); None: ``limits.DEFAULT_MAX_TOKENS_PER_REQUEST`` or max_model_len.
    max_tokens_per_request: int | None = None
    # --reasoning-parser (``reasoning.REASONING_PARSERS``): None, no reasoning output.
    reasoning_parser: str | None = None
    # The Responses API's stored responses (--responses-store-max-entries / -max-bytes, per tenant).
    responses_store: ResponseStore = field(default_factory=ResponseStore)
    # What runs the pooling routes (``pooling/service.py``), made on the first pooling request.
    pooling_service: Any = None

    def __post_init__(self) -> None:
        if (self.async_engine is None) == (self.load_engine is None):
            raise ValueError("ServerState needs exactly one of async_engine and load_engine")
        if self.max_tokens_per_request is not None and self.max_tokens_per_request < 1:
            raise ValueError(f"--max-tokens-per-request must be at least 1, got {self.max_tokens_per_request}")

    @property
    def model_names(self) -> list[str]:
        return [self.served_model_name, *self.model_aliases]

    @functools.cached_property
    def reasoning(self) -> ReasoningSettings | None:
        """The reasoning parser over the engine's tokenizer (``ValueError`` when it does not fit the model)."""
        if self.reasoning_parser is None:
            return None
        return ReasoningSettings.for_tokenizer(self.reasoning_parser, self.engine_info.tokenizer)

    def template_variables(self) -> frozenset[str]:
        """What the server's own chat template reads (``--chat-template``, else the
        model's): empty without one, or for one that does not parse (rendering says so)."""
        template = self.chat.chat_template or self.engine_info.tokenizer.chat_template
        try:
            return template_variables(template) if template else frozenset()
        except ValueError:
            return frozenset()

    @property
    def engine_info(self) -> EngineInfo:
        """The engine's fixed facts (tokenizer, limits, defaults); for routes, which never run while it loads."""
        if self.async_engine is None:
            raise RuntimeError("the engine is still loading")
        return self.async_engine.info

    @property
    def request_token_cap(self) -> int:
        """The work cap of one request (``--max-tokens-per-request`` or its default)."""
        from pagedllm.entrypoints.openai.common.limits import max_tokens_per_request

        return max_tokens_per_request(self.engine_info, self.max_tokens_per_request)

    @property
    def is_ready(self) -> bool:
        """The engine loop runs: false while the model loads, before start-up
        completes and after a failed step killed it."""
        return self.async_engine is not None and self.async_engine.is_running

    def not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"loading the model failed ({self.load_error!r}); see the server log"
        if self.async_engine is None:
            return "the model is still loading"
        return "the engine is not running (still starting, or its loop died: see the server log)"


TenantDependency = Callable[[Request], Awaitable[str | None]]  # the bearer-token check; returns the tenant


def check_model(state: ServerState, name: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names (None: the base model, by any of its
    served names or none); a 404 for a name this server does not serve."""
    if name is None or name in state.model_names:
        return None
    lora = state.adapters.get(name) if state.adapters is not None else None
    if lora is None:
        served = [*state.model_names, *(state.adapters.requests if state.adapters is not None else ())]
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", code="model_not_found", param="model")
    return lora


def tenant_of_key(api_keys: dict[str, str | None], presented: str | None) -> tuple[bool, str | None]:
    """(whether ``presented`` is one of the keys, its tenant). Compares against
    every key with ``secrets.compare_digest`` and never stops early, so the
    time taken does not tell how much of a key an attacker guessed right."""
    matched, tenant = False, None
    candidate = (presented or "").encode("utf-8")
    for key, key_tenant in api_keys.items():
        if secrets.compare_digest(key.encode("utf-8"), candidate):
            matched, tenant = True, key_tenant
    return matched and presented is not None, tenant


def presented_key(request: Request) -> str | None:
    """The API key a request presents: its ``Authorization: Bearer`` token, else its
    ``x-api-key`` header (how Anthropic's clients send it), if any."""
    header = request.headers.get("authorization", "")
    return header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key")


def cache_salt_of(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt a request runs with: its key's tenant's, applied
    server-side over the client's ``cache_salt``, so no client can pick another
    tenant's cached blocks (a fleet router hashes prompts with the same rule)."""
    return f"tenant:{tenant}" if tenant is not None else cache_salt

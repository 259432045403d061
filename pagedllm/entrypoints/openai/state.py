"""What every route of the server shares: the engine, the served name, the keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import ChatSettings
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.metrics import EngineMetrics


@dataclass
class ServerState:
    engine: LLMEngine
    served_model_name: str
    # API key -> tenant name (None: a key without a tenant). Empty: no auth.
    api_keys: dict[str, str | None] = field(default_factory=dict)
    async_engine: AsyncLLMEngine | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    chat: ChatSettings = field(default_factory=ChatSettings)  # --chat-template, --trust-request-chat-template


TenantDependency = Callable[[Request], str | None]  # the bearer-token check; returns the tenant


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.served_model_name!r}",
                       code="model_not_found", param="model")

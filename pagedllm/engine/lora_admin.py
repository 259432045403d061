"""Loading and unloading LoRA adapters by name, between steps (vLLM's ``add_lora`` /
``remove_lora``): what a server's ``--lora-modules`` and its load / unload endpoints
run in the engine, in-process (``AsyncLLMEngine``) or as engine-core utility calls.

A request names its adapter with a ``LoRARequest`` and the engine checks it the
first time it sees the name anyway; loading it ahead only moves that check to the
moment a server is asked to serve it, so a bad adapter is refused there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.lora.registry import AdapterRegistry
from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


def _registry(engine: LLMEngine) -> AdapterRegistry:
    if engine.adapter_registry is None:
        raise ValueError("the engine was started without LoRA; start it with enable_lora=True (--enable-lora)")
    return engine.adapter_registry


def add_lora(engine: LLMEngine, lora_request: LoRARequest) -> str:
    """Read and check the adapter against the base model now (``ValueError`` naming
    the problem: a missing file, a rank above ``max_lora_rank``, a shape that does not
    fit, a name already loaded from another path). Returns the fingerprint its blocks
    are keyed by beside its name, which a router needs to hash its prompts alike."""
    return _registry(engine).spec_for(lora_request).fingerprint


def remove_lora(engine: LLMEngine, lora_name: str) -> bool:
    """Forget an adapter (False: the engine does not know the name), so the name can
    be loaded again, from any path. Refused (``ValueError``) while requests under it
    are unfinished: they read its pages. Its idle pages are dropped now: the KV manager
    keeps resident adapters by name, so a new adapter of the name would otherwise
    revive the old weights. Its cached prefix blocks may stay: they are keyed by the
    name *and* the files' fingerprint, so only the same weights ever find them."""
    registry = _registry(engine)
    if lora_name not in registry.specs:
        return False
    users = sum(1 for request in engine.scheduler.requests.values()
                if request.lora is not None and request.lora.name == lora_name)
    if users:
        raise ValueError(f"LoRA adapter {lora_name!r} is used by {users} unfinished requests; unload it once "
                         "they have finished")
    engine.kv_cache_manager.drop_adapter(lora_name)
    registry.forget(lora_name)
    return True


def value_or_refusal(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(call(), None)``, or ``(None, message)`` when it refuses with a ``ValueError``:
    how a utility call of the engine core hands a refusal back as data, so the API
    process can answer it with a 400 carrying the message as it is."""
    try:
        return call(), None
    except ValueError as exc:
        return None, str(exc)

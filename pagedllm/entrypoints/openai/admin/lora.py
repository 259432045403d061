"""LoRA adapters served by name, as vLLM serves them: ``--lora-modules`` at start-up,
a request's ``model`` naming one, ``GET /v1/models`` listing them after the base,
and ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` at run time.

The engine checks an adapter the first time it sees its name and keys its
prefix-cache blocks and pages by that name; this API server keeps which names
it serves, each with a ``LoRARequest`` made once at load (``lora_int_id`` 1, 2,
... in order of loading), and refuses a name it does not serve with the 404 of
an unknown model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.errors import APIError, RequestFieldError, bad_request, error_responses
from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.common.state import ServerState, TenantDependency

_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` item (vLLM's class): the served name, the adapter's path
    (a PEFT folder or a GGUF LoRA file) and the base it names as its parent, if given."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: list[str]) -> list[LoRAModulePath]:
    """``--lora-modules`` items: ``name=path``, or vLLM's JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}``. ``ValueError`` naming the
    flag and the item for a malformed one or a name given twice."""
    modules = [_parse_module(item) for item in items]
    names = [module.name for module in modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules: the name {twice[0]!r} is given twice; give each adapter its own name")
    return modules


def _parse_module(item: str) -> LoRAModulePath:
    if item.lstrip().startswith("{"):
        try:
            fields = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {item!r}: invalid JSON ({exc})") from None
        if not isinstance(fields, dict) or not set(fields) <= _MODULE_KEYS or not all(
                isinstance(fields.get(key), str) and fields[key] for key in ("name", "path")) or not isinstance(
                fields.get("base_model_name", ""), str):
            raise ValueError(f"--lora-modules {item!r}: a JSON item is an object with the strings \"name\" and "
                             "\"path\" and, optionally, \"base_model_name\"")
        return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))
    name, equals, path = item.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules {item!r}: give name=path (or vLLM's JSON object "
                         "'{\"name\": ..., \"path\": ...}')")
    return LoRAModulePath(name, path)


class ServedAdapters:
    """The adapters one API server serves, by name.

    Safety rule: a name is reserved from the moment its load starts, so two loads of
    one name never both succeed; it is withdrawn before the engine forgets it, so no
    new request resolves to an adapter that is being unloaded."""

    def __init__(self, startup: list[LoRAModulePath] | None = None) -> None:
        self.startup = list(startup or [])
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str | None] = {}
        # What the engine keys each adapter's blocks by beside its name (a router hashes with it).
        self.fingerprints: dict[str, str] = {}
        self._loading: set[str] = set()
        self._next_id = 1

    def get(self, name: str) -> LoRARequest | None:
        return self.requests.get(name)

    async def load(self, engine: Any, module: LoRAModulePath, base_names: list[str]) -> LoRARequest:
        """Check the adapter in the engine and serve it under its name: a
        ``RequestFieldError`` naming ``lora_name`` for a name in use, ``lora_path`` with
        the engine's message for an adapter the engine refuses."""
        name = module.name
        if name in base_names:
            raise RequestFieldError("lora_name", f"the name {name!r} is the base model's served name; give the "
                                                 "adapter another name")
        if name in self.requests or name in self._loading:
            raise RequestFieldError("lora_name", f"The lora adapter '{name}' has already been loaded.")
        self._loading.add(name)
        try:
            fingerprint = await engine.add_lora(LoRARequest(name, self._next_id, module.path))
        except ValueError as exc:
            raise RequestFieldError("lora_path", str(exc)) from exc
        finally:
            self._loading.discard(name)
        request = self.requests[name] = LoRARequest(name, self._next_id, module.path)
        self.parents[name] = module.base_model_name
        self.fingerprints[name] = fingerprint
        self._next_id += 1
        return request

    async def unload(self, engine: Any, name: str) -> None:
        """Stop serving ``name`` and make the engine forget it (``ValueError`` for a
        name not served, or one with requests still running: then it stays served)."""
        request = self.requests.pop(name, None)
        if request is None:
            raise RequestFieldError("lora_name", f"The lora adapter '{name}' cannot be found.")
        try:
            await engine.remove_lora(name)
        except BaseException as exc:  # still served: the engine has not forgotten it
            self.requests[name] = request
            if isinstance(exc, ValueError):
                raise RequestFieldError("lora_name", str(exc)) from exc
            raise
        self.parents.pop(name, None)
        self.fingerprints.pop(name, None)

    async def load_startup(self, engine: Any, base_names: list[str]) -> None:
        """The ``--lora-modules``, in order, before the server serves anything; a refused
        one is a ``ValueError`` naming the item (``pagedllm serve`` then exits with status 1)."""
        for module in self.startup:
            try:
                await self.load(engine, module, base_names)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc

    def model_cards(self, base_name: str, max_model_len: int) -> list[dict]:
        """vLLM's ``/v1/models`` entries of the adapters: ``root`` the path, ``parent`` the base."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "pagedllm", "root": request.lora_path,
                 "parent": self.parents.get(name) or base_name, "max_model_len": max_model_len}
                for name, request in self.requests.items()]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``POST /v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``POST /v1/unload_lora_adapter`` (``lora_int_id`` is accepted and unused, as there)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


_TEXT_OK = {200: {"description": "a plain-text success message", "content": {"text/plain": {}}}}


def add_lora_routes(app: FastAPI, state: ServerState, tenant_of: TenantDependency) -> None:
    """The run-time load / unload endpoints (served whenever ``--enable-lora`` is on;
    vLLM also asks for ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), behind the API keys."""
    adapters = state.adapters

    @app.post(routes.LOAD_LORA_ADAPTER, response_class=PlainTextResponse,
              responses={**_TEXT_OK, **error_responses(400, 401, 503)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest,
                                tenant: str | None = Depends(tenant_of)) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_name" if not body.lora_name else "lora_path")
        try:
            await adapters.load(state.async_engine, LoRAModulePath(body.lora_name, body.lora_path), state.model_names)
        except ValueError as exc:
            raise bad_request(exc) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(routes.UNLOAD_LORA_ADAPTER, response_class=PlainTextResponse,
              responses={**_TEXT_OK, **error_responses(400, 401, 503)})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                                  tenant: str | None = Depends(tenant_of)) -> PlainTextResponse:
        try:
            await adapters.unload(state.async_engine, body.lora_name)
        except ValueError as exc:
            raise bad_request(exc) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

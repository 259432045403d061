"""The engine-client contract (``engine/client.py``): every client class has each
method of its protocol with the protocol's signature, and the factories build
each kind of client from the options."""

from __future__ import annotations

import inspect

import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.client import (AsyncEngineClient, CoreConnection, EngineClient, make_async_engine_client,
                                    make_engine_client)
from pagedllm.engine.core_client import AsyncEngineCoreClient
from pagedllm.engine.core_proxy import EngineCoreProxy
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.fleet.offline import OfflineFleet

SYNC_CLIENTS = [LLMEngine, EngineCoreProxy, OfflineFleet]
ASYNC_CLIENTS = [AsyncLLMEngine, AsyncEngineCoreClient]


def _members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def _mismatches(protocol: type, cls: type) -> list[str]:
    """How ``cls`` differs from ``protocol``: a member missing, a property that is not one,
    a sync/async mismatch, or a signature that differs (names, kinds, defaults, in order;
    ``cls`` may add keyword-only parameters with defaults)."""
    problems = []
    for name, wanted in _members(protocol).items():
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            problems.append(f"{cls.__name__}.{name} is missing")
        elif isinstance(wanted, property) or isinstance(have, property):
            if not (isinstance(wanted, property) and isinstance(have, property)):
                problems.append(f"{cls.__name__}.{name}: a property in one and not the other")
        elif inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(have):
            problems.append(f"{cls.__name__}.{name}: async in one and not the other")
        else:
            theirs = list(inspect.signature(have).parameters.values())
            ours = list(inspect.signature(wanted).parameters.values())
            shape = [(p.name, p.kind, p.default) for p in theirs if p.name in {q.name for q in ours}]
            extra = [p for p in theirs if p.name not in {q.name for q in ours}]
            if shape != [(p.name, p.kind, p.default) for p in ours] or any(
                    p.kind is not p.KEYWORD_ONLY or p.default is p.empty for p in extra):
                problems.append(f"{cls.__name__}.{name}{inspect.signature(have)} != {inspect.signature(wanted)}")
    return problems


@pytest.mark.parametrize("protocol, cls", [(EngineClient, cls) for cls in SYNC_CLIENTS]
                         + [(AsyncEngineClient, cls) for cls in ASYNC_CLIENTS])
def test_each_client_has_its_protocols_methods_with_their_signatures(protocol, cls):
    assert not _mismatches(protocol, cls)


def test_the_signature_check_sees_a_difference():
    class Wrong:
        def add_request(self, request_id, prompt, params=None, priority=0): ...

    assert any("add_request" in problem for problem in _mismatches(EngineClient, Wrong))
    assert any("step is missing" in problem for problem in _mismatches(EngineClient, Wrong))


def test_the_factories_build_the_in_process_clients(tiny_llama):
    engine = make_engine_client({"model": tiny_llama, "num_kv_blocks": 16})
    assert type(engine) is LLMEngine and isinstance(engine, EngineClient)
    client = make_async_engine_client(engine)
    assert type(client) is AsyncLLMEngine and isinstance(client, AsyncEngineClient)
    remote = make_async_engine_client(CoreConnection("ipc:///nowhere", name="api0"))  # connects on start()
    assert type(remote) is AsyncEngineCoreClient and isinstance(remote, AsyncEngineClient)
    assert remote.identity.startswith(b"api0-")
    with pytest.raises(ValueError, match="data_parallel_size"):
        make_engine_client({"model": tiny_llama}, data_parallel_size=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind, size, expected", [("engine_process", 1, EngineCoreProxy),
                                                  ("data_parallel", 2, OfflineFleet)])
def test_the_factory_builds_the_process_clients(tiny_llama, kind, size, expected):
    client = make_engine_client({"model": tiny_llama, "num_kv_blocks": 16}, engine_process=True,
                                data_parallel_size=size)
    try:
        assert type(client) is expected and isinstance(client, EngineClient)
        assert client.step() == [] and not client.has_unfinished_requests()
    finally:
        client.shutdown()

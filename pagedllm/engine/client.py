"""The engine-client contract: what holds an engine sees, whichever engine it is.

Two protocols, one per calling style, and one factory for each (vLLM's
``make_client`` shape). Nothing that holds a client asks which class it is.

- ``EngineClient`` (sync, driven by one thread: ``LLM``'s): ``LLMEngine`` in
  this process, ``EngineCoreProxy`` of an engine-core process, or
  ``OfflineFleet`` routing over several of those. ``make_engine_client``
  builds one from the engine options.
- ``AsyncEngineClient`` (the server's, on its event loop): ``AsyncLLMEngine``
  over an ``LLMEngine`` here, or ``AsyncEngineCoreClient`` of a core process.
  ``make_async_engine_client`` builds one from an engine or a ``CoreConnection``.

A request is sampled (``SamplingParams``), a beam search (``BeamSearchParams``)
or, on a pooling engine, a pooling request (``PoolingParams``), through the same ``add_request``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import RequestStream
    from pagedllm.engine.beam_search import BeamSearchParams
    from pagedllm.engine.core_process import EngineCoreProcess
    from pagedllm.engine.engine_info import EngineInfo
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """A blocking engine client.

    Safety rules: one thread calls it. ``add_request`` checks a request fully
    before queueing it: a bad one raises ``ValueError`` and changes nothing; every
    way a request ends (stop, length, stop string, ``abort_request``) frees its
    blocks. ``shutdown()`` stops every process the client started; safe twice."""

    def next_request_id(self) -> str:
        """A request id no earlier one of this client used."""

    def add_request(self, request_id: str, prompt: Any,
                    params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (None: the default ``SamplingParams``). A beam search's result is
        one finished output holding the ``beam_width`` best hypotheses, best first; a
        pooling request's one finished ``PoolingRequestOutput``.
        ``ValueError`` for a bad prompt or params, a reused id, an adapter it cannot run."""

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop these requests now and free their blocks; unknown ids are ignored."""

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` still has outputs to give."""

    def step(self) -> list[RequestOutput]:
        """Advance the queued requests one step; the outputs of those that made tokens
        (``finished`` on each one's last). [] when none is queued."""

    def get_tokenizer(self) -> Any: ...

    def get_image_processor(self) -> Any:
        """A vision-language model's ``ImagePromptProcessor`` (``multimodal/processing.py``); None: text only."""

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without params runs with (the checkpoint's generation config)."""

    def stats(self) -> dict:
        """``LLM.stats()``: the pool's, the scheduler's and the steps' counters."""

    def kv_pool_snapshot(self) -> dict:
        """The block pool as data, taken between steps."""

    def reset_prefix_cache(self) -> int:
        """Forget the cached blocks no request uses; how many."""

    def reset_peak_blocks_in_use(self) -> None: ...

    def check_invariants(self) -> None:
        """``RuntimeError`` on the first broken block-manager invariant."""

    @property
    def step_timings(self) -> dict[str, float]:
        """Seconds spent per phase of ``step()`` since the last ``reset_step_timings()``."""

    def reset_step_timings(self) -> None: ...

    def weight_bytes(self) -> int: ...

    def capacity_line(self) -> str:
        """The start-up description of the pool and its tiers."""

    def metrics_registry(self) -> Any:
        """What ``metrics.reader.get_metrics_snapshot`` walks (its ``collect()``)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class AsyncEngineClient(Protocol):
    """The server's engine client, on its event loop.

    Safety rules: ``start()`` from the running event loop, then await
    ``wait_ready()`` before anything else; ``info`` (fixed facts) is readable from
    any thread once ready; everything that reads or changes the scheduler or the
    pool runs between steps. A step that fails ends every open stream with
    ``EngineDeadError`` and ``is_running`` turns False (/health's 503)."""

    info: EngineInfo | None

    @property
    def is_running(self) -> bool: ...

    def start(self) -> None: ...

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the engine serves; ``RuntimeError`` when it cannot (the model did not load)."""

    async def stop(self) -> None:
        """Stop the client's tasks on this event loop (the engine stays up: ``shutdown``)."""

    def shutdown(self) -> None:
        """Shut down the engine (or the core process) this client started, once stopped."""

    def next_request_id(self, prefix: str) -> str: ...

    async def add_request(self, request_id: str, prompt: Any,
                          params: SamplingParams | BeamSearchParams | PoolingParams, *,
                          priority: int = 0, cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (``ValueError`` as ``EngineClient.add_request``); the stream of its outputs
        (a pooling request's: one finished ``PoolingRequestOutput``)."""

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Idempotent."""

    def end_all_requests(self) -> int:
        """End every request in flight, each stream with a last output finished "abort"
        (a shutdown past its deadline); how many. Call it on the event loop's thread."""

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """Check an adapter between steps (``ValueError`` naming the problem); its fingerprint."""

    async def remove_lora(self, lora_name: str) -> bool: ...

    async def reset_prefix_cache(self) -> int: ...

    async def metrics_text(self) -> bytes:
        """The engine's metrics in Prometheus' text format."""

    async def kv_pool_snapshot(self) -> dict: ...

    def compile_structured_outputs(self, params: SamplingParams) -> None:
        """``ValueError`` (``StructuredOutputError``) when the engine cannot enforce ``params``'
        constraint. Call it on the event loop's thread."""


def make_engine_client(options: dict[str, Any], *, engine_process: bool = False,
                       data_parallel_size: int = 1) -> EngineClient:
    """The sync client ``options`` (``EngineConfig.from_options``' keywords, ``model``
    included) ask for: with ``data_parallel_size`` > 1 a fleet of that many
    engine-core processes, with ``engine_process`` one of them, else the engine in
    this process. Bad options raise ``ValueError`` here, before any process starts."""
    from pagedllm.config.engine import EngineConfig
    from pagedllm.fleet.offline import check_data_parallel_size

    check_data_parallel_size(data_parallel_size)
    config = EngineConfig.from_options(**options)
    if data_parallel_size > 1:
        from pagedllm.engine.core_proxy import EngineCoreProxy
        from pagedllm.fleet.offline import OfflineFleet, replica_options

        each = replica_options(options, data_parallel_size)
        return OfflineFleet.start(lambda: EngineCoreProxy(each), data_parallel_size)
    if engine_process:
        from pagedllm.engine.core_proxy import EngineCoreProxy

        return EngineCoreProxy(options)
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(config)


@dataclass(frozen=True)
class CoreConnection:
    """An engine-core process for an async client to talk to, at ``address``.

    ``core``: the process this client launched and supervises (None when another
    process does, as with ``--api-server-count`` > 1); ``restart`` starts it again
    when it dies, else ``on_core_exit`` is called once."""

    address: str
    core: EngineCoreProcess | None = None
    restart: bool = False
    on_core_exit: Callable[[int | None], None] | None = None
    name: str = "api"  # the prefix of the client's identity (and of its request ids)


def make_async_engine_client(engine: LLMEngine | CoreConnection | AsyncEngineClient) -> AsyncEngineClient:
    """The async client of an engine built in this process, or of a core process (a client
    already, an encoder server's engine-less one: itself)."""
    if isinstance(engine, AsyncEngineClient):
        return engine
    if isinstance(engine, CoreConnection):
        from pagedllm.engine.core_client import AsyncEngineCoreClient

        return AsyncEngineCoreClient(engine.address, engine.core, restart=engine.restart,
                                     on_core_exit=engine.on_core_exit, name=engine.name)
    from pagedllm.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine(engine)

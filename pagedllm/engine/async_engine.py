"""An asyncio front for the engine: many concurrent callers, one engine loop.

Requests are added as they arrive; one background task runs ``LLMEngine.step``
in a worker thread (so a forward pass never blocks the event loop) and routes
each step's outputs to the per-request queues.

This is the server's one door to the engine. What never changes after start-up
(tokenizer, limits, defaults, the metrics registry) is ``info``, readable from
any thread. Everything that reads or changes the scheduler or the block pool
(adding, aborting, resetting the prefix cache, the pool snapshot) runs between
steps, under ``_lock``, which the loop holds for the whole of each step: none
of it can interleave with a step's bookkeeping in the worker thread.

A step that raises kills the loop (vLLM's ``EngineDeadError``): the half-done
step may have left the pool inconsistent, so every live request is aborted
and failed, later requests are refused, and the server's /health answers 503
so an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.lora_admin import add_lora, remove_lora
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after a failed step; restart the server."""


# Put on an open stream's queue by ``end_requests``: the stream ends with its latest output, finished "abort".
_END_ABORTED = object()


def end_requests(queues: dict[str, asyncio.Queue], abort: Callable[[str], None]) -> int:
    """End every request whose stream is open (``queues``: request id -> its stream's
    queue) as a shutdown's deadline does: the engine stops it (``abort``, which forgets
    its queue, so nothing follows) and its stream's last output is its latest one,
    finished with "abort". How many there were."""
    request_ids = list(queues)
    for request_id in request_ids:
        queues[request_id].put_nowait(_END_ABORTED)
        abort(request_id)
    return len(request_ids)


def aborted_output(latest: RequestOutput | None, request_id: str) -> RequestOutput:
    """``latest`` finished with "abort" (sequences that had finished keep their reason);
    a request ended before its first step has one empty choice."""
    if latest is None:
        return RequestOutput(request_id, None, [], None, [CompletionOutput(0, "", [], None, None, "abort")], True)
    outputs = [replace(c, finish_reason=c.finish_reason or "abort") for c in latest.outputs]
    return replace(latest, outputs=outputs, finished=True)


class RequestStream:
    """The outputs of one request, one per step it advanced, the last ``finished``.

    Safety rule: a consumer that stops early must call ``abort()`` (idempotent,
    a no-op once finished), typically in a ``finally``; the request's blocks
    are then freed before the next step.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._latest: RequestOutput | None = None  # what an end by ``end_requests`` finishes
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is _END_ABORTED:
            item = aborted_output(self._latest, self.request_id)
        self._latest = item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncLLMEngine:
    """Safety rules: call ``start()`` from the running event loop before
    ``add_request``; reach the ``LLMEngine`` only through these methods (its
    ``step`` runs in another thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.info = EngineInfo.of(engine)
        self.dead_error: BaseException | None = None  # why the loop died, once it has
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_aborts: set[str] = set()
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._ids = 0

    @property
    def is_running(self) -> bool:
        """The loop is started and has not died (what /health reports)."""
        return self._loop_task is not None and not self._loop_task.done() and self.dead_error is None

    def start(self) -> None:
        if self._loop_task is None:
            # Fresh ones on this event loop: asyncio's lock and event belong to the
            # first loop that waits on them, and one app may be served by several
            # loops in turn (a test client per test).
            self._lock, self._wakeup = asyncio.Lock(), asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Ready once started (the engine is built before this object), so
        ``timeout_s`` never runs out: the engine-core client's counterpart waits for its process."""

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    def shutdown(self) -> None:
        """Shut the engine down once the loop is stopped (``LLMEngine.shutdown``:
        the disk tier's queued writes, the event publisher, tensor-parallel ranks)."""
        if self._loop_task is not None:
            raise RuntimeError("stop() the engine loop before shutting the engine down")
        self._engine.shutdown()

    def next_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request now, sampled, a beam search or a pooling request (``LLMEngine.add_request``:
        raises ``ValueError`` at once for a bad one) and return the stream of its outputs."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died ({self.dead_error!r}); restart the server")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            self._engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                     lora_request=lora_request)
            self._queues[request_id] = queue
        self._wakeup.set()
        return RequestStream(request_id, queue, self.abort)

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream gets nothing more, and the loop frees its
        blocks before the next step (never during one). Idempotent."""
        self._queues.pop(request_id, None)
        self._pending_aborts.add(request_id)
        self._wakeup.set()

    def end_all_requests(self) -> int:
        """End every request in flight, each stream with a last output finished
        "abort" (``end_requests``: a shutdown past its deadline); how many."""
        return end_requests(self._queues, self.abort)

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """Check an adapter now, between steps (``lora_admin.add_lora``: ``ValueError``
        naming the problem; its fingerprint); its files are read in a worker thread, so
        the event loop keeps answering meanwhile."""
        async with self._lock:
            return await asyncio.to_thread(add_lora, self._engine, lora_request)

    async def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter between steps (``lora_admin.remove_lora``); False if unknown."""
        async with self._lock:
            return remove_lora(self._engine, lora_name)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached block no request uses, between steps; returns how many."""
        async with self._lock:
            return self._engine.reset_prefix_cache()

    async def metrics_text(self) -> bytes:
        """The engine's metrics in Prometheus' text format (prometheus_client makes
        reading the registry while a step updates it safe)."""
        from prometheus_client import generate_latest

        return generate_latest(self._engine.metrics_registry())

    async def kv_pool_snapshot(self) -> dict:
        """The block pool as data (``LLM.kv_pool_snapshot``), taken between
        steps, so its blocks and its counters are from the same moment."""
        async with self._lock:
            return self._engine.kv_pool_snapshot()

    def compile_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint (xgrammar caches it, so ``add_request``
        does not compile it again); raises ``ValueError`` (a ``StructuredOutputError``
        naming the constraint's field) when the engine cannot enforce it.

        Safety rule: call it on the event loop's thread. It takes no lock: it
        reads only the tokenizer and the grammar compiler, which no step uses
        (steps use the compiled grammars' matchers) and only this thread calls
        (``add_request`` compiles here too)."""
        self._engine.structured_output.compile(params)

    async def _run_loop(self) -> None:
        while True:
            if not self._engine.has_unfinished_requests() and not self._pending_aborts:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._lock:
                if self._pending_aborts:
                    self._engine.abort_request(sorted(self._pending_aborts))
                    self._pending_aborts.clear()
                if not self._engine.has_unfinished_requests():
                    continue  # the aborts freed blocks (and updated the metrics); nothing to step
                try:
                    outputs = await asyncio.to_thread(self._engine.step)
                except Exception as exc:
                    logger.exception("engine step failed: the engine loop stops")
                    self._die(exc)
                    return
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                    if output.finished:
                        del self._queues[output.request_id]

    def _die(self, exc: Exception) -> None:
        """Abort every live request (freeing its blocks) and fail every stream."""
        self.dead_error = exc
        self._engine.abort_request(list(self._engine.requests))
        for request_id, queue in self._queues.items():
            queue.put_nowait(EngineDeadError(f"request {request_id} failed: the engine step raised {exc!r}"))
        self._queues.clear()

"""An asyncio front for the engine: many concurrent callers, one engine loop.

Requests are added as they arrive; one background task runs ``LLMEngine.step``
in a worker thread (so a forward pass never blocks the event loop) and routes
each step's outputs to the per-request queues. The engine is only touched
between steps, under ``_lock``, so adding and aborting never race a forward
pass.

A step that raises kills the loop (vLLM's ``EngineDeadError``): the half-done
step may have left the pool inconsistent, so every live request is aborted
and failed, later requests are refused, and the server's /health answers 503
so an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.logger import init_logger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after a failed step; restart the server."""


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
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncLLMEngine:
    """Safety rule: call ``start()`` from the running event loop before ``add_request``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
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
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    def next_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request now (raises ``ValueError`` at once for a bad one) and
        return the stream of its outputs."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died ({self.dead_error!r}); restart the server")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            self.engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt)
            self._queues[request_id] = queue
        self._wakeup.set()
        return RequestStream(request_id, queue, self._abort_later)

    def _abort_later(self, request_id: str) -> None:
        # Applied by the loop before its next step: never in the middle of a forward pass.
        self._queues.pop(request_id, None)
        self._pending_aborts.add(request_id)
        self._wakeup.set()

    async def _run_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests() and not self._pending_aborts:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._lock:
                if self._pending_aborts:
                    self.engine.abort_request(sorted(self._pending_aborts))
                    self._pending_aborts.clear()
                if not self.engine.has_unfinished_requests():
                    continue  # the aborts freed blocks (and updated the metrics); nothing to step
                try:
                    outputs = await asyncio.to_thread(self.engine.step)
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
        self.engine.abort_request(list(self.engine.requests))
        for request_id, queue in self._queues.items():
            queue.put_nowait(EngineDeadError(f"request {request_id} failed: the engine step raised {exc!r}"))
        self._queues.clear()

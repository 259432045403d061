"""Shutdown with a deadline, at the HTTP level: what the API server and the
router do on SIGTERM (Kubernetes' way of stopping a pod).

The sequence (``DrainingServer``): on SIGTERM the server starts draining. New
requests get a 503 with ``Retry-After`` and an OpenAI-shaped error, and
``/health`` answers 503 ``draining`` (a failing readiness probe, so Kubernetes
takes the pod out of its Service's endpoints; the listening socket stays open
meanwhile, so a client that still reaches it is told to retry elsewhere rather
than refused). Requests in flight run for up to ``--shutdown-timeout`` seconds;
then ``end_the_rest`` ends those left (the API server's engine finishes them
with finish_reason "abort" and a final event), and uvicorn's own shutdown
follows, bounded too, after which the server's cleanup runs (the engine's disk
tier finishes its queued writes) and the process exits 0. A second SIGTERM, or
SIGINT, is uvicorn's plain graceful shutdown.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.errors import error_body
from pagedllm.logger import init_logger

logger = init_logger(__name__)

# What a refused client is told to wait: its retry goes to the load balancer, which by then
# routes around this server (its /health fails), so a short wait is enough.
RETRY_AFTER_S = 1
# After the deadline: how long the ended requests get to send their final events, and how
# long uvicorn's own shutdown may then wait for connections before it cuts them.
FINAL_EVENTS_S = 5.0
# Answered as usual while draining: metrics stay scrapable to the end.
_PASSED_THROUGH = frozenset({routes.METRICS, routes.VERSION})
_DRAINING_CODE = "draining"  # the error code of every answer while draining


class Drain:
    """Whether this server is draining, how many requests it is running, and what
    a drain does: ``on_draining()`` when it starts (the router stops its replicas
    then, so they drain alongside), ``end_the_rest()`` at the deadline (how many
    requests it ended).

    Safety rule: use it on the server's event loop only (the middleware and
    ``run`` share its counters without a lock); the callbacks must not block."""

    def __init__(self, timeout_s: float, end_the_rest: Callable[[], int] = lambda: 0,
                 on_draining: Callable[[], None] = lambda: None) -> None:
        if timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.end_the_rest, self.on_draining = end_the_rest, on_draining
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None  # made on the loop, by run()

    async def run(self) -> None:
        """Refuse new requests; wait up to ``timeout_s`` for those in flight, then
        end the rest and give their final events ``FINAL_EVENTS_S``."""
        self.draining = True
        self._idle = asyncio.Event()
        logger.info("SIGTERM: draining (new requests get 503): %d in flight get up to %.0f s",
                    self.in_flight, self.timeout_s)
        self.on_draining()
        if await self._idle_within(self.timeout_s):
            return
        in_flight = self.in_flight
        ended = self.end_the_rest()
        logger.warning("the shutdown timeout (%.0f s) passed with %d requests in flight: the engine ended %d "
                       "(finish_reason abort), the rest are closed", self.timeout_s, in_flight, ended)
        await self._idle_within(FINAL_EVENTS_S)

    async def _idle_within(self, timeout_s: float) -> bool:
        if self.in_flight == 0:
            return True
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def request_done(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()


class RefuseWhileDraining:
    """ASGI middleware: counts the requests in flight (until the last byte of a
    stream is sent), and while draining answers new ones with a 503 and
    ``Retry-After``, ``/health`` with a 503 ``draining``."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _PASSED_THROUGH:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _refuse(send, scope["path"] == routes.HEALTH)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.request_done()


def says_draining(status: int, body: bytes) -> bool:
    """Whether a server's answer is ``RefuseWhileDraining``'s (the router reads its replicas' /health so)."""
    if status != 503:
        return False
    try:
        return json.loads(body)["error"]["code"] == _DRAINING_CODE
    except (ValueError, KeyError, TypeError):
        return False


async def _refuse(send: Send, health: bool) -> None:
    message = "the server is shutting down and takes no new requests; retry (another server)"
    body = json.dumps(error_body("draining" if health else message, "server_error", code=_DRAINING_CODE)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if not health:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains on the first SIGTERM (``Drain.run``), then shuts
    down as usual; other signals keep uvicorn's handling."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.drain.draining or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # Not re-raised after the shutdown (as uvicorn does with the signals it handles): serve
        # then returns normally, its caller cleans up and the process exits 0.
        self.drain.draining = True
        self._loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        self._draining = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.config.timeout_graceful_shutdown = FINAL_EVENTS_S  # what is still open is cut
            self.should_exit = True

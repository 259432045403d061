"""A generation route whose client goes away before the answer is sent stops
its engine requests (vLLM's ``with_cancellation``).

A streamed answer already stops so: Starlette's ``StreamingResponse`` sees the
disconnect and closes the event generator, whose ``finally`` aborts the requests.
A whole (non-streamed) answer is produced before anything is sent, so without this
a client that timed out would leave its requests running to ``max_tokens``, their
blocks held, while its retry queues behind them.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

# nginx's "client closed request": logged for a request whose client left; nobody reads it.
CLIENT_CLOSED_REQUEST = 499


def cancel_on_disconnect(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``route`` (which takes a ``request: Request`` keyword) cancelled when its client
    disconnects first. Cancelling it aborts its engine requests: ``finals`` and
    ``stream_events`` abort their streams in ``finally``.

    Safety: the route must have read its body before it awaits anything long (FastAPI
    parses the body before calling it), since the watcher reads the request's ASGI
    messages, which after the body are only ``http.disconnect``; and it must not read
    them itself. A route that returns a stream returns at once, which ends the
    watcher before the ``StreamingResponse`` starts listening for the disconnect."""

    @functools.wraps(route)
    async def cancellable(*args: Any, **kwargs: Any) -> Any:
        answer = asyncio.ensure_future(route(*args, **kwargs))
        watcher = asyncio.ensure_future(_disconnected(kwargs["request"]))
        try:
            await asyncio.wait((answer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:  # done, or this handler was cancelled: stop whichever still runs
            for task in (answer, watcher):
                task.cancel()
        if answer.done() and not answer.cancelled():
            return answer.result()
        await asyncio.gather(answer, return_exceptions=True)  # let its finally abort the requests
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    return cancellable


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

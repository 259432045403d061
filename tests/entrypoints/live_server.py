"""A uvicorn server for an app in a thread of the test process (in-process
tests that need a real socket: TLS, concurrent streaming clients)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def uvicorn_thread(app, options: dict) -> Iterator[uvicorn.Server]:
    """``app`` served by uvicorn with ``options`` (what ``uvicorn.run`` would have got) in a
    thread, once it listens; stopped on exit. The model may still be loading then."""
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=30)

"""A uvicorn server for an app in a thread of the test process (in-process
tests that need a real socket: TLS, concurrent streaming clients), and the
pool check of a live server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn


@contextlib.contextmanager
def uvicorn_thread(app, options: dict) -> Iterator[uvicorn.Server]:
    """``app`` served by uvicorn with ``options`` (what ``uvicorn.run`` would have got) in a
    thread, once it listens; stopped on exit. The model may still be loading then."""
    server = uvicorn.Server(uvicorn.Config(app, **options))
    with server_thread(server):
        yield server


@contextlib.contextmanager
def server_thread(server: uvicorn.Server) -> Iterator[threading.Thread]:
    """``server`` run in a thread, once it listens (the thread, to see whether it ended);
    asked to exit, and joined, on exit."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield thread
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def assert_server_pool_free(base: str, headers: dict | None = None) -> None:
    """Nothing running or waiting on the server at ``base``, no block in use, and after a
    prefix-cache reset every block free."""
    deadline = time.time() + 60
    while True:
        counters = httpx.get(f"{base}/v1/kv_pool", headers=headers).json()["counters"]
        if counters["blocks_in_use"] == 0 and counters["num_running"] == 0 and counters["num_waiting"] == 0:
            break
        assert time.time() < deadline, counters
        time.sleep(0.2)
    httpx.post(f"{base}/reset_prefix_cache", headers=headers)
    pool = httpx.get(f"{base}/v1/kv_pool", headers=headers).json()
    assert pool["counters"]["free_blocks"] == pool["num_blocks"] and pool["counters"]["cached_blocks"] == 0

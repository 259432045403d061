"""A `pagedllm serve` (or any HTTP server) child process on a free local port, for benches and tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import httpx

from pagedllm.utils import free_port

__all__ = ["free_port", "running_command", "running_server", "serve_command"]


@contextlib.contextmanager
def running_server(server_args: list[str], start_timeout_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """Start ``pagedllm serve *server_args``, wait until /health answers, yield
    (base URL, process id), and stop it on exit. The first start on a machine may
    compile the CPU kernels, hence the long timeout."""
    with running_command(serve_command(server_args), start_timeout_s) as started:
        yield started


def serve_command(server_args: list[str]) -> Callable[[int], list[str]]:
    """``pagedllm serve *server_args`` on a given port, as ``running_command`` takes it."""
    return lambda port: [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
                         *server_args]


@contextlib.contextmanager
def running_command(command_of_port: Callable[[int], list[str]],
                    start_timeout_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """Start any HTTP server's command (given the free port it is to listen on), wait
    until its /health answers 200, yield (base URL, process id), and stop it on exit
    (SIGTERM, SIGKILL after 30 s). Its output goes to a temporary file (a pipe nobody
    reads would block a chatty server); its tail is in the error when the server exits
    or never becomes healthy."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command_of_port(port), stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + start_timeout_s
            while True:
                if server.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the server did not start:\n{log.read()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                        break
                time.sleep(0.5)  # refused, or 503 while the model loads
            yield base_url, server.pid
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

"""Shutdown with a deadline (``entrypoints/draining``): on SIGTERM new requests get a
503 with ``Retry-After``, ``/health`` says draining, requests in flight finish if
they end within ``--shutdown-timeout``, else they end with finish_reason "abort",
their final chunk and ``[DONE]``; the engine's pool is all free afterwards."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import uvicorn

from pagedllm import LLM
from pagedllm.bench.server_process import running_command, running_server
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.draining import Drain, DrainingServer, RefuseWhileDraining
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.utils import free_port
from tests.conftest import assert_pool_free_once_idle
from tests.entrypoints.live_server import server_thread

LONG_STREAM = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True,
               "temperature": 0}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=256, max_num_seqs=4)


@contextlib.contextmanager
def draining_server(llm, timeout_s: float) -> Iterator[tuple[str, DrainingServer, threading.Thread]]:
    """The app over ``llm`` served in a thread by ``DrainingServer`` with a ``timeout_s`` drain."""
    engine = AsyncLLMEngine(llm.llm_engine)
    drain = Drain(timeout_s, engine.end_all_requests)
    app = RefuseWhileDraining(build_app(ServerState(async_engine=engine, served_model_name="tiny")), drain)
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), drain)
    with server_thread(server) as thread:
        yield f"http://127.0.0.1:{port}", server, thread


class StreamReader:
    """A stream read to its end in a thread: its data events, once ``first`` is set."""

    def __init__(self, url: str, body: dict) -> None:
        self.events: list[str] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()
        assert self.first.wait(30), "the stream sent nothing"

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))
                    self.first.set()

    def finish_reason(self, timeout_s: float) -> str:
        """The last chunk's finish_reason, once the stream ended with [DONE]."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2])["choices"][0]["finish_reason"]


def assert_draining(base: str) -> None:
    """Refusals while draining, once it has begun (a supervising process passes SIGTERM on
    to its API servers within its 0.25 s watch interval)."""
    deadline = time.monotonic() + 5
    while httpx.get(f"{base}/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.05)
    refused = httpx.post(f"{base}/v1/completions", json={**LONG_STREAM, "stream": False}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["message"] == "draining"
    assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200  # still scrapable


def test_a_stream_past_the_deadline_ends_with_abort_and_done(llm):
    with draining_server(llm, timeout_s=1.0) as (base, server, thread):
        stream = StreamReader(f"{base}/v1/completions", LONG_STREAM)
        signalled = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        assert_draining(base)
        assert stream.finish_reason(timeout_s=15) == "abort"
        thread.join(timeout=15)
        assert not thread.is_alive() and time.monotonic() - signalled < 10
    assert_pool_free_once_idle(llm)


def test_a_stream_within_the_deadline_finishes_normally(llm):
    with draining_server(llm, timeout_s=120.0) as (base, server, thread):
        stream = StreamReader(f"{base}/v1/completions", LONG_STREAM)
        server.handle_exit(signal.SIGTERM, None)
        assert_draining(base)
        assert stream.finish_reason(timeout_s=120) == "length"
        thread.join(timeout=15)  # idle: the server stops without waiting for the deadline
        assert not thread.is_alive()
    assert_pool_free_once_idle(llm)


def model_of(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def sigterm_and_check(base: str, pid: int, shutdown_timeout_s: float, finish_reason: str,
                      max_tokens: int = LONG_STREAM["max_tokens"]) -> None:
    """SIGTERM ``pid`` during a long stream through ``base``: refusals while it drains, the
    stream's ``finish_reason``, exit status 0 soon after the deadline."""
    stream = StreamReader(f"{base}/v1/completions",
                          {**LONG_STREAM, "model": model_of(base), "max_tokens": max_tokens})
    process = psutil.Process(pid)
    signalled = time.monotonic()
    process.terminate()
    assert_draining(base)
    assert stream.finish_reason(timeout_s=shutdown_timeout_s + 30) == finish_reason
    assert process.wait(timeout=shutdown_timeout_s + 30) == 0
    assert time.monotonic() - signalled < shutdown_timeout_s + 20


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--engine-process"], ["--no-engine-process"], ["--api-server-count", "2"]])
def test_serve_drains_on_sigterm_and_exits_0(tiny_llama, mode):
    """The real signal on `pagedllm serve`, in each of its process layouts: a long stream past
    ``--shutdown-timeout 1`` ends with abort and [DONE]; the server exits 0 (its core stopped)."""
    with running_server([tiny_llama, "--host", "127.0.0.1", "--num-kv-blocks", "256", "--shutdown-timeout", "1",
                         *mode], start_timeout_s=300) as (base, pid):
        sigterm_and_check(base, pid, 1.0, "abort")


@pytest.mark.slow
def test_the_router_drains_its_proxied_stream_on_sigterm(tiny_llama):
    """`pagedllm router` on SIGTERM: 503 + Retry-After, /health draining, the stream it proxies
    finishes (within the deadline), exit 0; the replica is not its own and keeps serving."""
    replica_flags = [tiny_llama, "--host", "127.0.0.1", "--num-kv-blocks", "256"]
    with running_server(replica_flags, start_timeout_s=300) as (replica, _):
        router = lambda port: [sys.executable, "-m", "pagedllm.cli", "router", "--replica", replica,
                               "--model", tiny_llama, "--host", "127.0.0.1", "--port", str(port),
                               "--shutdown-timeout", "120"]
        with running_command(router, start_timeout_s=120) as (base, pid):
            sigterm_and_check(base, pid, 120.0, "length", max_tokens=1000)  # long enough to be in flight
        assert httpx.get(f"{replica}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_data_parallel_serve_drains_its_replicas_on_sigterm(tiny_llama):
    """`serve --data-parallel-size 2 --shutdown-timeout 1`: the router passes SIGTERM to its
    replicas, the long stream ends with abort and [DONE] through it, everything exits 0."""
    with running_server([tiny_llama, "--host", "127.0.0.1", "--num-kv-blocks", "256", "--data-parallel-size", "2",
                         "--shutdown-timeout", "1"], start_timeout_s=600) as (base, pid):
        replicas = psutil.Process(pid).children()
        sigterm_and_check(base, pid, 1.0, "abort")
        assert not any(replica.is_running() and replica.status() != psutil.STATUS_ZOMBIE for replica in replicas)

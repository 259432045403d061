"""`pagedllm serve` when its engine-core process dies: open streams end with an
API-shaped error, the server exits with status 1 or, with
--restart-engine-on-failure, starts a new core and serves again; and
--api-server-count N serves through N API processes in front of one core."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from pagedllm.bench.server_process import free_port, running_server

pytestmark = pytest.mark.slow

LONG_STREAM = {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}


def engine_core_of(server: psutil.Process) -> psutil.Process:
    """The core: the server's first process started by multiprocessing's spawn
    (API server processes, when there are several, are started after it)."""
    spawned = [child for child in server.children()
               if any("spawn_main" in part for part in child.cmdline())]
    return min(spawned, key=lambda child: child.create_time())


def model_of(base: str) -> str:
    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


def kill_core_mid_stream(base: str, core: psutil.Process) -> list[dict]:
    """Start a long stream, SIGKILL the core after its first token; the events
    the stream sent after that (it must end within a few seconds)."""
    with httpx.stream("POST", f"{base}/v1/completions", json={"model": model_of(base), **LONG_STREAM},
                      timeout=30) as response:
        events = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        assert "choices" in json.loads(next(events))
        core.kill()
        killed = time.monotonic()
        after = [json.loads(event) for event in events if event != "[DONE]"]
    assert time.monotonic() - killed < 3, "the stream outlived its dead core"
    return after


def test_a_dead_core_ends_open_streams_and_stops_the_server(tiny_llama):
    with running_server([tiny_llama, "--num-kv-blocks", "256"], start_timeout_s=120) as (base, pid):
        server = psutil.Process(pid)
        after = kill_core_mid_stream(base, engine_core_of(server))
        assert after[-1]["error"]["code"] == "engine_dead" and after[-1]["error"]["type"] == "server_error"
        assert server.wait(timeout=30) == 1


def test_restart_engine_on_failure_serves_again(tiny_llama):
    args = [tiny_llama, "--num-kv-blocks", "256", "--restart-engine-on-failure"]
    with running_server(args, start_timeout_s=120) as (base, pid):
        server = psutil.Process(pid)
        first_core = engine_core_of(server)
        body = {"model": model_of(base), "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        before = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        after = kill_core_mid_stream(base, first_core)
        assert after[-1]["error"]["code"] == "engine_dead"
        refused = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        if refused.status_code != 200:  # the new core may already be up; until then, a 503 that says why
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline, "the restarted core never became ready"
            time.sleep(0.2)
        assert engine_core_of(server).pid != first_core.pid and server.is_running()
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        assert again == before
        assert httpx.get(f"{base}/metrics").status_code == 200


def test_several_api_servers_share_one_core(tiny_llama):
    args = [tiny_llama, "--num-kv-blocks", "256", "--api-server-count", "2"]
    with running_server(args, start_timeout_s=120) as (base, pid):
        server = psutil.Process(pid)
        api_servers = [child for child in server.children() if child.pid != engine_core_of(server).pid
                       and any("spawn_main" in part for part in child.cmdline())]
        assert len(api_servers) == 2
        body = {"model": model_of(base), "prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0}

        async def many() -> list[str]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))
            return [answer.json()["choices"][0]["text"] for answer in answers]

        texts = asyncio.run(many())
        assert len(set(texts)) == 1 and texts[0]
        engine_core_of(server).kill()
        assert server.wait(timeout=30) == 1


@pytest.mark.parametrize("flags", [["--engine-process"], ["--no-engine-process"],
                                   ["--restart-engine-on-failure"]])  # (restarts are of a core once ready)
def test_a_model_that_cannot_load_stops_the_server_with_status_1(tmp_path, flags):
    (tmp_path / "config.json").write_text("{not json")
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tmp_path), *flags,
               "--port", str(free_port())]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1, finished.stderr[-2000:]
    assert "loading the model failed" in finished.stderr


def test_sigterm_stops_the_server_and_its_core_cleanly(tiny_llama):
    """SIGTERM: uvicorn's graceful shutdown, then the core is stopped and its private socket
    folder removed, and serve exits with status 0 (not killed by the re-raised signal)."""
    with running_server([tiny_llama, "--num-kv-blocks", "64"], start_timeout_s=120) as (base, pid):
        server = psutil.Process(pid)
        core = engine_core_of(server)
        sockets = [c.laddr for c in core.net_connections(kind="unix") if c.laddr.endswith("core.sock")]
        folder = os.path.dirname(sockets[0])
        assert os.path.isdir(folder)
        server.terminate()
        assert server.wait(timeout=60) == 0
        core.wait(timeout=10)
        assert not os.path.exists(folder)


def test_several_api_servers_stop_when_the_model_cannot_load(tmp_path):
    """With N API servers the supervisor sees only the core's exit: one soon after its start
    is not restarted (it would loop), even with --restart-engine-on-failure."""
    (tmp_path / "config.json").write_text("{not json")
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tmp_path), "--api-server-count", "2",
               "--restart-engine-on-failure", "--port", str(free_port())]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1, finished.stderr[-2000:]
    assert "30 s or less after its start" in finished.stderr

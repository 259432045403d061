"""`pagedllm serve --data-parallel-size 2`: replicas as local processes (mp) and
as Ray actors on a local Ray cluster the test starts and stops. Greedy text
equals a single engine's, prefixes are routed to where they are cached, a
replica that dies after serving is restarted and rejoins, SIGTERM stops all."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import httpx
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import running_command
from pagedllm.utils import free_port
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import assert_server_pool_free
from tests.entrypoints.test_router_live import replicas_up, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["The harbour master counted the ships", "Once upon a time in a quiet village",
           "The recipe needs three eggs and", "In 1850 the railway reached the town of",
           "Our support team answers every question about billing within"]
SHARED = "Shared instructions for every request: be brief, be exact, never guess. " * 6


def fleet_command(model: str, *extra: str) -> list[str]:
    # A short drain deadline: these tests stop an idle fleet, and with the default 30 s its
    # worst case (replicas' deadline, their final events, the router's wait) passes the
    # tests' wait for the exit on a loaded machine.
    return [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--served-model-name", "m",
            "--host", "127.0.0.1", "--data-parallel-size", "2", "--num-threads", "1", "--num-kv-blocks", "128",
            "--health-interval", "0.25", "--disable-log-stats", "--uvicorn-log-level", "warning",
            "--shutdown-timeout", "5", *extra]


@pytest.fixture(scope="module")
def single_engine_texts(tiny_llama) -> list[str]:
    llm = LLM(tiny_llama, num_kv_blocks=128)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert_pool_free(llm)
    return [output.outputs[0].text for output in outputs]


def check_fleet(base: str, single_engine_texts: list[str], tag: str) -> None:
    wait_until(lambda: replicas_up(base) == 2, 180, "both replicas never came up")
    texts = [httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
        for prompt in PROMPTS]
    assert texts == single_engine_texts
    cached = [httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "m", "prompt": f"{tag}: {SHARED}Question {n}?", "max_tokens": 4, "temperature": 0,
    }).json()["usage"]["prompt_tokens_details"]["cached_tokens"] for n in range(3)]
    assert cached[0] == 0 and min(cached[1:]) >= 64, cached


def replica_servers(pid: int) -> list[psutil.Process]:
    return [child for child in psutil.Process(pid).children(recursive=True)
            if "serve" in child.cmdline() and "--data-parallel-size" not in child.cmdline()]


def test_mp_replicas_match_one_engine_restart_and_stop(tiny_llama, single_engine_texts):
    with running_command(lambda port: [*fleet_command(tiny_llama), "--port", str(port)],
                         start_timeout_s=180) as (base, pid):
        check_fleet(base, single_engine_texts, "first")
        servers = replica_servers(pid)
        assert len(servers) == 2
        if len(os.sched_getaffinity(0)) >= 2:  # each replica pinned to its own cores
            assert not set(servers[0].cpu_affinity()) & set(servers[1].cpu_affinity())
        victim = servers[0]
        for proc in [victim, *victim.children(recursive=True)]:
            proc.kill()
        wait_until(lambda: replicas_up(base) == 1, 30, "the router never marked the dead replica down")
        wait_until(lambda: replicas_up(base) == 2, 180, "the replica was not restarted")
        assert victim.pid not in [server.pid for server in replica_servers(pid)]
        check_fleet(base, single_engine_texts, "after the restart")
        for server in replica_servers(pid):
            port = server.cmdline()[server.cmdline().index("--port") + 1]
            assert_server_pool_free(f"http://127.0.0.1:{port}")
        fleet = psutil.Process(pid)
        everything = [fleet, *fleet.children(recursive=True)]
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(everything, timeout=30)
        assert not alive, alive


@contextlib.contextmanager
def local_ray_cluster() -> Iterator[str]:
    """``ray start --head`` with 2 CPUs in a short private temp dir; ``ray stop`` on exit."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    started = subprocess.run([ray, "start", "--head", "--port", str(port), "--num-cpus", "2", "--temp-dir", temp_dir,
                              "--include-dashboard", "false", "--disable-usage-stats"],
                             capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_replicas_serve_the_same_text_and_stop(tiny_llama, single_engine_texts):
    with local_ray_cluster() as address:
        command = [*fleet_command(tiny_llama, "--data-parallel-backend", "ray", "--ray-address", address)]
        with running_command(lambda port: [*command, "--port", str(port)], start_timeout_s=240) as (base, pid):
            check_fleet(base, single_engine_texts, "ray")
            too_many = subprocess.run([*command[:-2], "--ray-address", address, "--num-threads", "4", "--port",
                                       str(free_port())], capture_output=True, text=True, timeout=120)
            assert too_many.returncode == 2 and "the Ray cluster has 2:" in too_many.stderr, too_many.stderr[-2000:]
            fleet = psutil.Process(pid)
            fleet.send_signal(signal.SIGTERM)
            assert fleet.wait(timeout=90) == 0


def test_tensor_parallel_replicas_serve_the_same_text(tiny_llama, single_engine_texts):
    """--data-parallel-size 2 x --tensor-parallel-size 2: each replica splits its heads over 2 ranks."""
    command = [*fleet_command(tiny_llama), "--tensor-parallel-size", "2"]
    with running_command(lambda port: [*command, "--port", str(port)], start_timeout_s=240) as (base, pid):
        wait_until(lambda: replicas_up(base) == 2, 240, "both replicas never came up")
        texts = [httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
            for prompt in PROMPTS]
        assert texts == single_engine_texts
        spawned = [p for p in psutil.Process(pid).children(recursive=True)
                   if any("spawn_main" in part for part in p.cmdline())]
        assert len(spawned) == 4  # per replica: its engine core and one tensor-parallel worker

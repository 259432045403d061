"""The HTTP router's parts without a server: events addresses, merged metrics,
the replica supervisor of serve --data-parallel-size, a replica's command line."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from pagedllm.entrypoints.router import launch
from pagedllm.entrypoints.router.metrics_merge import merge_expositions
from pagedllm.entrypoints.router.replica import events_address


def test_events_address_uses_the_replica_host_for_wildcards():
    assert events_address("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert events_address("tcp://0.0.0.0:5557", "http://node-2:8000") == "tcp://node-2:5557"
    assert events_address("tcp://10.0.0.9:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.9:5557"
    assert events_address("ipc:///tmp/x", "http://127.0.0.1:8000") == "ipc:///tmp/x"


def test_metrics_merge_labels_each_replica_once_per_family():
    text = ('# HELP pagedllm:num_requests_running Running\n# TYPE pagedllm:num_requests_running gauge\n'
            'pagedllm:num_requests_running{model_name="m"} 2.0\n')
    merged = merge_expositions({"0": text, "1": text.replace("2.0", "5.0"), "2": "not { metrics"})
    assert merged.count("# TYPE pagedllm:num_requests_running gauge") == 1
    assert 'pagedllm:num_requests_running{replica="0",model_name="m"} 2.0' in merged
    assert 'pagedllm:num_requests_running{replica="1",model_name="m"} 5.0' in merged


class FakeReplica:
    def __init__(self) -> None:
        self.starts, self.code, self.stopped = 0, None, False

    def start(self) -> str:
        self.starts += 1
        self.code = None
        return "http://127.0.0.1:1"

    def exit_code(self):
        return self.code

    def stop(self) -> None:
        self.stopped = True


def test_supervisor_restarts_a_replica_that_served_and_stops_for_one_that_never_did(monkeypatch):
    monkeypatch.setattr(launch, "_SUPERVISE_INTERVAL_S", 0.01)
    stops: list[bool] = []
    replicas = [FakeReplica(), FakeReplica()]
    supervisor = launch.ReplicaSupervisors(replicas, lambda: stops.append(True))
    supervisor.start()
    supervisor.was_ready = lambda rank: rank == 1  # replica 1 has answered once, replica 0 never
    replicas[1].code = -9
    _wait_for(lambda: replicas[1].starts == 2)
    assert not stops and not supervisor.failed
    replicas[0].code = 1
    _wait_for(lambda: stops)
    assert supervisor.failed and replicas[0].starts == 1
    supervisor.stop()
    assert all(r.stopped for r in replicas)


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_replica_command_passes_the_engine_and_serve_flags(tiny_llama):
    from pagedllm.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", tiny_llama, "--num-kv-blocks", "64", "--data-parallel-size", "2",
                                      "--api-key", "k1", "--served-model-name", "a", "b",
                                      "--max-tokens-per-request", "5000"])
    command = launch.replica_command(args, "127.0.0.1", 9000, "ipc:///tmp/e", "ipc:///tmp/r", threads=1)
    joined = " ".join(command)
    for part in ("--num-kv-blocks 64", "--port 9000", "--num-threads 1", "--api-key k1",
                 "--served-model-name a b", "--max-tokens-per-request 5000", f"--model {tiny_llama}", '"replay_endpoint": "ipc:///tmp/r"'):
        assert part in joined, part
    assert "--data-parallel-size" not in joined and isinstance(args, argparse.Namespace)


def test_a_stopped_watch_closes_its_event_socket_so_the_context_terminates():
    """The router's shutdown: it cancels each replica's watch, then terminates its zmq
    context, which blocks until every socket is closed. A watch that followed a
    replica's events must have closed that socket once its cancellation is awaited."""
    import asyncio
    import threading

    import httpx
    import zmq
    import zmq.asyncio
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from pagedllm.entrypoints.router.replica import Replica, ReplicaWatch, stop_watches
    from pagedllm.fleet.prefix_index import PrefixIndex
    from pagedllm.utils import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    info = {"prompt_fingerprint": "f", "block_size": 16, "model": "m",
            "kv_events": {"enable_kv_cache_events": True, "endpoint": endpoint}}
    replica_app = Starlette(routes=[Route("/health", lambda request: JSONResponse({})),
                                    Route("/server_info", lambda request: JSONResponse(info)),
                                    Route("/metrics", lambda request: JSONResponse({}))])

    async def follow_then_stop() -> tuple[bool, bool]:
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        publisher.bind(endpoint)
        replica = Replica(0, "http://replica")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(replica_app)) as client:
            watch = asyncio.create_task(ReplicaWatch(replica, PrefixIndex(), client, "f", context, 0.01).run())
            for _ in range(500):  # until it joined and its follower waits on the socket
                await asyncio.sleep(0.01)
                if replica.up:
                    break
            await asyncio.sleep(0.05)
            up = replica.up
            publisher.close()
            await stop_watches([watch])
            # As the router's lifespan does, with no await in between; in a thread so a hang fails the test.
            terminated = threading.Event()
            threading.Thread(target=lambda: (context.term(), terminated.set()), daemon=True).start()
            return up, terminated.wait(10)

    up, terminated = asyncio.run(follow_then_stop())
    assert up
    assert terminated, "a socket of the stopped watch is still open"


def test_a_cleanup_that_hangs_past_the_deadline_still_ends_the_fleet_process():
    """``exit_by_deadline``: a stopped fleet whose cleanup hangs (a never-ending exit handler,
    as leaving a Ray cluster has done) exits by the deadline with its status, the stacks logged."""
    script = ("import atexit, threading, time\n"
              "from pagedllm.entrypoints.router.launch import exit_by_deadline\n"
              "atexit.register(lambda: threading.Event().wait())\n"
              "exit_by_deadline(1.0, lambda: 3)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "took over 1 s" in done.stderr and "(most recent call first)" in done.stderr  # the hung handler shows
    assert time.monotonic() - started < 30

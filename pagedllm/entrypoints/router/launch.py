"""``pagedllm serve --data-parallel-size N``: N replicas and the router in front of them.

Each replica is a whole ``pagedllm serve`` (its own API server, engine-core
process and KV pool) with ``1/N`` of the cores, publishing its KV events to the
router. ``--data-parallel-backend mp`` starts them as child processes of this
one, on 127.0.0.1, each pinned to its share of the cores; ``ray`` starts each
inside a Ray actor that Ray places on any node of the cluster
(``--ray-address``), bound to that node's address. This process serves the
router on ``--host``/``--port`` and supervises the replicas: one that exits is
started again (the router marks it down at once and takes it back once it
answers), unless it exits before it ever answered, which means it cannot
start at all; then the whole server stops with status 1.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Protocol

from pagedllm.config.engine import threads_per_rank
from pagedllm.engine.supervisor import Supervisor
from pagedllm.entrypoints.draining import FINAL_EVENTS_S
from pagedllm.entrypoints.engine_args import engine_flags_from_args
from pagedllm.logger import init_logger
from pagedllm.utils import free_port

logger = init_logger(__name__)

_SUPERVISE_INTERVAL_S = 0.5
# What the cleanup after the router stops may take beyond the replicas' own grace: leaving a
# Ray cluster has been seen to hang (its driver's shutdown), and the fleet must still exit.
_CLEANUP_SLACK_S = 30.0
# serve flags that every replica gets as they are (the engine's own come from engine_flags_from_args).
_PASSED_FLAGS = ("served_model_name", "api_key", "api_keys_file", "chat_template", "metrics_namespace",
                 "log_stats_interval", "uvicorn_log_level", "timeout_keep_alive", "lora_modules",
                 "max_tokens_per_request", "shutdown_timeout")
_PASSED_SWITCHES = ("trust_request_chat_template", "disable_log_stats", "restart_engine_on_failure")


class ReplicaProcess(Protocol):
    """A replica wherever it runs: ``start`` returns its base URL."""

    def start(self) -> str: ...
    def exit_code(self) -> int | None: ...
    def stop(self) -> None: ...


def replica_command(args: argparse.Namespace, host: str, port: int, events: str, replay: str,
                    threads: int) -> list[str]:
    """The ``pagedllm serve`` command line of one replica."""
    command = [sys.executable, "-m", "pagedllm.cli", "serve", *engine_flags_from_args(args),
               "--host", host, "--port", str(port), "--num-threads", str(threads),
               "--kv-events-config", f'{{"enable_kv_cache_events": true, "endpoint": "{events}", '
                                     f'"replay_endpoint": "{replay}"}}']
    for name in _PASSED_FLAGS:
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "api_key":
            for key in value:
                command += [flag, key]
        else:
            command += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    command += ["--" + name.replace("_", "-") for name in _PASSED_SWITCHES if getattr(args, name)]
    return command


def threads_per_replica(args: argparse.Namespace) -> int:
    """Each replica rank's threads: ``--num-threads``, else the cores shared among every rank."""
    return threads_per_rank(args.num_threads, args.tensor_parallel_size, args.data_parallel_size) or 1


class LocalReplica:
    """A replica as a child process on this machine (``mp``), pinned to ``cores``.
    It keeps its port and sockets across restarts, so the router finds it again."""

    def __init__(self, args: argparse.Namespace, rank: int, cores: set[int] | None, socket_dir: str) -> None:
        base = os.path.join(socket_dir, f"replica-{rank}")
        self.port = free_port()
        self.command = replica_command(args, "127.0.0.1", self.port, f"ipc://{base}-events",
                                       f"ipc://{base}-replay", threads_per_replica(args))
        self.cores = cores
        self.grace_s = replica_grace_s(args)
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        cores = self.cores
        self.process = subprocess.Popen(self.command,
                                        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        return f"http://127.0.0.1:{self.port}"

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def stop(self) -> None:
        stop_process(self.process, self.grace_s)


def replica_grace_s(args: argparse.Namespace) -> float:
    """How long a SIGTERM'd replica may take: its drain, its final events, its cleanup."""
    return args.shutdown_timeout + 2 * FINAL_EVENTS_S


def stop_process(process: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """SIGTERM (the server stops its engine core and closes its streams), SIGKILL after ``grace_s``."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def core_shares(replicas: int) -> list[set[int] | None]:
    """Disjoint core sets, one per replica, when this process may use enough cores; else no pinning."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < replicas:
        return [None] * replicas
    share = len(cores) // replicas
    return [set(cores[i * share:(i + 1) * share]) for i in range(replicas)]


class _AtItsUrl:
    """A replica as a supervised ``Child``: started again, it must come back at the
    URL it had, the only one the router knows it by."""

    def __init__(self, replica: ReplicaProcess, rank: int) -> None:
        self.replica, self.rank = replica, rank
        self.url: str | None = None

    def start(self) -> str:
        url = self.replica.start()
        if self.url is not None and url != self.url:
            logger.error("replica %d came back at %s, not %s: the router cannot follow it", self.rank, url, self.url)
        self.url = self.url or url
        return url

    def exit_code(self) -> int | None:
        return self.replica.exit_code()


class ReplicaSupervisors:
    """One ``Supervisor`` per replica, on one watch thread: a replica that exits
    after it had served is started again; one that exits before it ever
    answered cannot start, so everything stops (``failed``)."""

    def __init__(self, replicas: list[ReplicaProcess], stop_router: Callable[[], None]) -> None:
        self.replicas, self.stop_router = replicas, stop_router
        self.urls: list[str] = []
        self.failed = False
        self.supervisors = [Supervisor(_AtItsUrl(replica, rank), f"replica {rank}", True, self._failed)
                                for rank, replica in enumerate(replicas)]
        # Whether replica i has answered (the router's watch knows); set once the router exists. It is
        # the router's ``ever_up``: a replica that served once stays restartable across its restarts.
        self.was_ready: Callable[[int], bool] = lambda rank: False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="replica-supervisor", daemon=True)
        self._stoppers: list[threading.Thread] = []

    def start(self) -> list[str]:
        self.urls = [supervisor.start() for supervisor in self.supervisors]
        self._thread.start()
        return self.urls

    def _watch(self) -> None:
        while not self._stopping.wait(_SUPERVISE_INTERVAL_S):
            for rank, supervisor in enumerate(self.supervisors):
                if self._stopping.is_set():
                    return
                if self.was_ready(rank):
                    supervisor.ready()
                if not supervisor.check():
                    return

    def _failed(self, exitcode: int | None) -> None:
        self.failed = True
        self.stop_router()

    def stop_soon(self) -> None:
        """Stop supervising and SIGTERM every replica now, without waiting: they drain
        alongside the router (its drain calls this). Idempotent."""
        self._stopping.set()
        if not self._stoppers:
            self._stoppers = [threading.Thread(target=replica.stop, name=f"replica-{rank}-stop", daemon=True)
                              for rank, replica in enumerate(self.replicas)]
            for stopper in self._stoppers:
                stopper.start()

    def stop(self) -> None:
        """Stop every replica (``stop_soon``) and wait until they have exited."""
        self.stop_soon()
        for stopper in self._stoppers:
            stopper.join()


def exit_by_deadline(deadline_s: float, exit_code: Callable[[], int]) -> None:
    """Make sure the process ends within ``deadline_s`` from now: the router has stopped, and
    what is left (stopping the replicas, leaving the Ray cluster, the interpreter's exit
    handlers) is cleanup that must not keep a stopped fleet alive. Past the deadline every
    thread's stack is logged (what hung) and the process exits with ``exit_code()``."""
    def expire() -> None:
        logger.error("the cleanup after the router stopped took over %.0f s; every thread's stack follows, "
                     "then the process exits", deadline_s)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(exit_code())

    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True  # it never keeps the interpreter alive; it runs until the very end if that hangs
    timer.start()


def serve_data_parallel(args: argparse.Namespace) -> int:
    """Run the replicas and the router until SIGTERM/SIGINT; the exit status."""
    from pagedllm.entrypoints.draining import Drain
    from pagedllm.entrypoints.router.router_command import router_state, serve_router
    from pagedllm.entrypoints.serve_setup import ServerStopper

    if args.kv_events_config:
        raise ValueError("--kv-events-config: with --data-parallel-size the server sets each replica's event "
                         "sockets itself (the router follows them); leave it out")
    if args.data_parallel_backend == "ray":
        from pagedllm.entrypoints.router.ray_replicas import ray_replicas

        replicas, release = ray_replicas(args, threads_per_replica(args))  # a cluster too small raises here
        socket_dir = None
    else:
        socket_dir = tempfile.mkdtemp(prefix="pagedllm-fleet-")  # the replicas' event sockets, private (0700)
        replicas, release = [LocalReplica(args, rank, cores, socket_dir)
                             for rank, cores in enumerate(core_shares(args.data_parallel_size))], None
    stop_router = ServerStopper()
    supervisor = ReplicaSupervisors(replicas, stop_router)
    try:
        state = router_state(args, supervisor.start())
        supervisor.was_ready = lambda rank: state.replicas[rank].ever_up  # a bool read across threads
        # The replicas end their streams at --shutdown-timeout; the router waits for those final events.
        drain = Drain(args.shutdown_timeout + FINAL_EVENTS_S, on_draining=supervisor.stop_soon)
        serve_router(args, state, stop_router, drain)
    finally:
        exit_by_deadline(replica_grace_s(args) + _CLEANUP_SLACK_S, lambda: 1 if supervisor.failed else 0)
        supervisor.stop()
        if release is not None:
            release()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
    return 1 if supervisor.failed else 0

"""The processes of `pagedllm serve`: one engine core, one or more API servers.

With ``--api-server-count 1`` (the default) the API server runs in this process
and supervises the core itself (``AsyncEngineCoreClient``). With N > 1 this
process binds the port, starts N API server processes that share the
listening socket (the kernel spreads connections over them) and supervises
them and the core: a core that dies is started again with
``--restart-engine-on-failure`` (the API servers reconnect), otherwise, like an
API server that dies, it stops everything with status 1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import socket
import sys
import time

from pagedllm.engine.client import CoreConnection
from pagedllm.engine.core_client import LIVENESS_INTERVAL_S
from pagedllm.engine.core_process import CoreLaunch, EngineCoreProcess
from pagedllm.engine.supervisor import Supervisor
from pagedllm.entrypoints.draining import FINAL_EVENTS_S
from pagedllm.entrypoints.serve_setup import (ServerStopper, server_drain, run_uvicorn, server_state,
                                              uvicorn_options)
from pagedllm.entrypoints.engine_args import engine_options_from_args
from pagedllm.logger import init_logger

logger = init_logger(__name__)

# With --api-server-count N > 1 this process cannot see the core's Ready (only the API servers
# talk to it): the core counts as ready once it has run this long, so one that exits sooner
# (it most likely cannot load the model) is not restarted.
MIN_CORE_UPTIME_TO_RESTART_S = 30.0


def serve_with_engine_process(args: argparse.Namespace, names: list[str]) -> int:
    """Run the server with the engine core in its own process; the exit status."""
    launch = CoreLaunch(engine_options_from_args(args), CoreLaunch.new_address(), served_model_name=names[0],
                        metrics_namespace=args.metrics_namespace,
                        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval)
    core = EngineCoreProcess(launch)
    core.start()
    try:
        if args.api_server_count == 1:
            return _serve_here(args, names, core)
        return _serve_with_api_processes(args, names, core)
    finally:
        core.shutdown()


def _serve_here(args: argparse.Namespace, names: list[str], core: EngineCoreProcess) -> int:
    from pagedllm.entrypoints.openai.api_server import build_app

    core_died = False
    stop_server = ServerStopper()

    def core_exited(exitcode: int | None) -> None:
        nonlocal core_died
        core_died = True
        logger.error("the engine core exited (status %s): the server stops", exitcode)
        stop_server()  # open streams have ended with their error event

    state = server_state(args, names, lambda: CoreConnection(
        core.launch.address, core, restart=args.restart_engine_on_failure, on_core_exit=core_exited), stop_server)
    run_uvicorn(build_app(state, args.allowed_origins), uvicorn_options(args), stop_server,
                server_drain(args, state))
    return 1 if core_died or state.load_error is not None else 0


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _api_server_main(args: argparse.Namespace, names: list[str], sock: socket.socket, address: str,
                     index: int) -> None:
    """One API server process: the app over a client of the shared core, on the shared socket.
    It exits with status 1 when the core never became ready (the supervisor then stops all)."""
    from pagedllm.entrypoints.openai.api_server import build_app

    stop_server = ServerStopper()
    state = server_state(args, names, lambda: CoreConnection(address, name=f"api{index}"), stop_server)
    run_uvicorn(build_app(state, args.allowed_origins), uvicorn_options(args), stop_server,
                server_drain(args, state), sockets=[sock])
    if state.load_error is not None:
        sys.exit(1)


def _serve_with_api_processes(args: argparse.Namespace, names: list[str], core: EngineCoreProcess) -> int:
    sock = _listening_socket(args.host, args.port)
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=_api_server_main, args=(args, names, sock, core.launch.address, index),
                               name=f"pagedllm-api-{index}") for index in range(args.api_server_count)]
    for server in servers:
        server.start()
    logger.info("%d API servers on %s:%d in front of the engine core (pid %d)",
                len(servers), args.host, args.port, core.pid)
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    supervisor = Supervisor(core, "the engine core", args.restart_engine_on_failure, lambda exitcode: None,
                            ready_after_s=MIN_CORE_UPTIME_TO_RESTART_S)
    try:
        while not stopping:
            time.sleep(LIVENESS_INTERVAL_S)
            if not supervisor.check():
                status = 1
                break
            dead = [server.name for server in servers if server.exitcode is not None]
            if dead:
                logger.error("API server %s exited: the server stops", ", ".join(dead))
                status = 1
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for server in servers:
            server.terminate()  # each drains: its requests in flight get --shutdown-timeout, then end
        for server in servers:
            server.join(args.shutdown_timeout + 2 * FINAL_EVENTS_S)
            if server.exitcode is None:
                server.kill()
        sock.close()
    return status

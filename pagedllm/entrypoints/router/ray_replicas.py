"""Replicas as Ray actors (``serve --data-parallel-backend ray``): Ray places them.

Each actor reserves its replica's share of CPUs on whatever node Ray picks and
runs ``pagedllm serve`` there as a child process, bound to that node's address
with ports chosen on it once (a restart keeps them, so the router finds the
replica again). The child dies with its actor (``PR_SET_PDEATHSIG``), so a killed
actor or a stopped cluster leaves no server behind. Start the cluster first
(``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the
others, every node with the same pagedllm installed) and give the server
``--ray-address HEAD:6379``; without it Ray starts a local instance.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import subprocess
from collections.abc import Callable

import ray

from pagedllm.entrypoints.router.launch import ReplicaProcess, replica_command, replica_grace_s, stop_process
from pagedllm.utils import free_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@ray.remote
class ReplicaActor:
    """One replica's server on this actor's node."""

    def __init__(self, args: argparse.Namespace, threads: int) -> None:
        self.address = ray.util.get_node_ip_address()
        self.port = free_port("0.0.0.0")
        self.command = replica_command(args, "0.0.0.0", self.port, f"tcp://*:{free_port('0.0.0.0')}",
                                       f"tcp://*:{free_port('0.0.0.0')}", threads)
        self.grace_s = replica_grace_s(args)
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        self.process = subprocess.Popen(self.command, preexec_fn=_die_with_parent)
        return f"http://{self.address}:{self.port}"

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def server_pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self) -> None:
        stop_process(self.process, self.grace_s)


class RayReplica:
    """``ReplicaProcess`` over an actor handle. A dead actor reads as an exited replica."""

    def __init__(self, actor, grace_s: float) -> None:
        self.actor, self.grace_s = actor, grace_s

    def start(self) -> str:
        return ray.get(self.actor.start.remote())

    def exit_code(self) -> int | None:
        try:
            return ray.get(self.actor.exit_code.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return -1

    def stop(self) -> None:
        try:
            ray.get(self.actor.stop.remote(), timeout=self.grace_s + 10)
        except ray.exceptions.RayError:
            pass
        ray.kill(self.actor)


def ray_replicas(args: argparse.Namespace, threads: int) -> tuple[list[ReplicaProcess], Callable[[], None]]:
    """``args.data_parallel_size`` actors, each reserving ``threads`` CPUs x tensor-parallel ranks; and
    the function that disconnects from the cluster once they are stopped."""
    ray.init(address=args.ray_address, ignore_reinit_error=True, log_to_driver=False)
    cpus = threads * args.tensor_parallel_size
    available = ray.cluster_resources().get("CPU", 0)
    if cpus * args.data_parallel_size > available:
        ray.shutdown()
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} x {cpus} CPUs each needs "
                         f"{cpus * args.data_parallel_size} CPUs; the Ray cluster has {available:g}: "
                         "add nodes (ray start --address=...) or lower --num-threads / --data-parallel-size")
    replicas: list[ReplicaProcess] = [RayReplica(ReplicaActor.options(num_cpus=cpus).remote(args, threads),
                                                 replica_grace_s(args))
                                      for _ in range(args.data_parallel_size)]
    return replicas, ray.shutdown

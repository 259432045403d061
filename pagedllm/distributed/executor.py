"""The driver's side of tensor parallelism: start the other ranks, join the
process group with them, and send them every step.

Rank 0 is the engine process itself (it also holds shard 0 and samples, as in
vLLM); ranks 1..N-1 are worker processes it spawns with
``torch.multiprocessing``, or that ``pagedllm worker`` started elsewhere (by
hand or by ``torchrun``) when ``distributed_init_method`` is given. Every
collective has a timeout, and before each step the driver checks that the
processes it spawned are alive, so a dead worker is a clear ``RuntimeError``
rather than a hang.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.worker.runner_spec import RunnerSpec

logger = init_logger(__name__)

# What a spawned rank runs: ``worker_main(rank, world_size, init_method, timeout_s, device_type)``.
RankMain = Callable[[int, int, str, float, str], None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class DistributedExecutor:
    """Owns rank 0's membership of the group and the spawned workers.

    ``worker_main`` is what each spawned process runs (the engine passes
    ``pagedllm.worker.tp_worker.worker_main``: the rank loop builds a model
    runner, which this package stands below)."""

    def __init__(self, engine_config, world_size: int, device_type: str, worker_main: RankMain) -> None:
        self.world_size = world_size
        timeout_s = engine_config.distributed_timeout_s
        init_method = engine_config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        self.processes: list[mp.Process] = []
        if engine_config.distributed_init_method is None:
            context = mp.get_context("spawn")
            for rank in range(1, world_size):
                process = context.Process(
                    target=worker_main, args=(rank, world_size, init_method, timeout_s, device_type), daemon=True,
                    name=f"pagedllm-tp-worker-{rank}",
                )
                process.start()
                self.processes.append(process)
        dist.init_process_group(
            backend_for(device_type), init_method=init_method, rank=0, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.closed = False
        # Workers learn the configuration from here (one started by torchrun knows nothing else).
        dist.broadcast_object_list([engine_config], src=0)
        logger.info("tensor parallel: %d ranks over %s (%s)", world_size, backend_for(device_type), init_method)

    def check_workers(self) -> None:
        """Raise if a spawned worker has exited (its collectives would never come)."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                self.closed = True
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                    "the engine cannot continue: restart it"
                )

    def send_runner_spec(self, spec: RunnerSpec) -> None:
        """Send every worker the spec its runner is built from (after the configuration)."""
        dist.broadcast_object_list([spec], src=0)

    def broadcast_step(self, step) -> None:
        """Send one step's inputs (``StepInputs``) to every worker."""
        if self.closed:
            raise RuntimeError("the tensor-parallel engine was shut down or lost a worker; restart it")
        self.check_workers()
        dist.broadcast_object_list([step], src=0)

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them, and leave the group. Safe to call twice."""
        if self.closed and not self.processes:
            return
        if not self.closed:
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError as exc:  # a worker already gone: nothing to tell
                logger.warning("could not stop tensor-parallel workers cleanly: %s", exc)
        self.closed = True
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []
        if dist.is_initialized():
            dist.destroy_process_group()

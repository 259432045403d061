"""A tensor-parallel worker: rank 1..N-1 of the group (``pagedllm worker``, or
spawned by the driver's ``DistributedExecutor``).

It holds one shard of the weights and its share of every KV block (1/N of the
KV heads, the same block ids as every other rank), and runs exactly what the
driver broadcasts: block moves, then the forward, whose all-reduces it takes
part in. It never schedules, samples or sees a request. The engine's
configuration arrives from the driver, so a worker started by hand or by
``torchrun`` needs only its rank, the world size and the init method.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from pagedllm.config.engine import EngineConfig
from pagedllm.distributed.executor import backend_for
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.worker.rank import RunnerPlan, build_rank
from pagedllm.worker.runner_spec import RunnerSpec


def _receive(obj_type=None):
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if obj_type is not None and not isinstance(box[0], obj_type):
        raise RuntimeError(f"expected {obj_type.__name__} from the driver, got {type(box[0]).__name__}")
    return box[0]


def worker_main(rank: int, world_size: int, init_method: str, timeout_s: float, device_type: str) -> None:
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device_type), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        config: EngineConfig = _receive(EngineConfig)
        # The spec comes after the configuration: rank 0 sends it once its own shard is loaded.
        runner = build_rank(config, device, TensorParallelGroup(rank=rank, world_size=world_size),
                            lambda shard: RunnerPlan(_receive(RunnerSpec)))
        while (step := _receive()) is not None:
            runner.run_step(step)
    finally:
        dist.destroy_process_group()


def main_from_environment(init_method: str | None, rank: int | None, world_size: int | None,
                          timeout_s: float, device_type: str) -> None:
    """``pagedllm worker``: rank and world size from the flags, else from
    torchrun's RANK / WORLD_SIZE (and MASTER_ADDR / MASTER_PORT for env://)."""
    rank = rank if rank is not None else int(os.environ["RANK"])
    world_size = world_size if world_size is not None else int(os.environ["WORLD_SIZE"])
    if rank < 1 or rank >= world_size:
        raise ValueError(f"a worker's rank must be 1..{world_size - 1} (rank 0 is the engine), got {rank}")
    worker_main(rank, world_size, init_method or "env://", timeout_s, device_type)

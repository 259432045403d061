"""Building one tensor-parallel rank: the one sequence every rank runs at start-up.

The thread rule, then this rank's shard of the model, then a model runner over
this rank's share of the KV pool (made resident with ``kv_cache_pretouch``).
Rank 0 (``LLMEngine``) and ranks 1..N-1 (``tp_worker``) both build themselves
with ``build_rank``; they differ only in where the runner's spec comes from,
which each passes as ``plan_runner``: rank 0 plans the pool from its loaded
shard, starts the other ranks and sends them the spec, and its runner samples
(EOS ids, drafts, the step broadcast); the other ranks receive the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedllm.config.engine import EngineConfig, threads_per_rank
from pagedllm.config.pooling import PoolerSpec
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.base import CausalLM
from pagedllm.model.shard import ModelShard, load_model_shard
from pagedllm.worker.block_moves import pretouch_pool
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.runner_spec import RunnerSpec
from pagedllm.worker.step_inputs import StepInputs


@dataclass(frozen=True)
class RunnerPlan:
    """What a rank's runner is built from, decided once its shard is loaded."""

    spec: RunnerSpec
    # Rank 0's alone, since it samples and drives the other ranks; a worker keeps the defaults.
    eos_token_ids: Sequence[int] = ()
    broadcast_step: Callable[[StepInputs], None] | None = None
    speculative_config: SpeculativeConfig | None = None
    draft_model: CausalLM | None = None
    pooler: PoolerSpec | None = None  # a pooling engine's: what its decoder pools


def build_rank(config: EngineConfig, device: torch.device, group: TensorParallelGroup,
               plan_runner: Callable[[ModelShard], RunnerPlan]) -> ModelRunner:
    """Build rank ``group.rank`` of ``config``'s engine on ``device``: take its threads,
    load its shard, ask ``plan_runner`` for the runner's plan (rank 0's also keeps the
    shard's tokenizer and resolved options), and return the runner over the shard's model.

    Safety rule: every rank passes the same ``config`` (workers receive rank 0's),
    so every rank takes the same threads and cuts its shard from the same model."""
    if (threads := threads_per_rank(config.num_threads, group.world_size)) is not None:
        torch.set_num_threads(threads)  # the ranks share the machine's cores rather than each taking all
    shard = load_model_shard(config, device, group)
    plan = plan_runner(shard)
    runner = ModelRunner(shard.model, plan.spec, device, eos_token_ids=plan.eos_token_ids,
                         broadcast_step=plan.broadcast_step, speculative_config=plan.speculative_config,
                         draft_model=plan.draft_model, pooler=plan.pooler)
    if config.cache.kv_cache_pretouch:
        pretouch_pool(runner.kv_caches, runner.host_store)
    return runner

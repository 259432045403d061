"""LLMEngine: add requests, step the batch, collect outputs.

It owns the tokenizer, the scheduler (with the KV cache manager) and the
model runner, and turns sampled token ids into text, logprobs and finish
reasons.
"""

from __future__ import annotations

import gc
import os
import random
import weakref
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.config import EngineConfig, torch_dtype
from pagedllm.core.contiguous import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.beam_search import BeamGroup, BeamSearchManager, BeamSearchParams
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.logger import init_logger
from pagedllm.distributed.executor import DistributedExecutor, PoolShape
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.shard import load_model_shard
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv
from pagedllm.worker.memory import plan_kv_pool
from pagedllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    """The engine core behind ``LLM`` and the server.

    Safety rules: ``add_request`` validates everything before the request
    enters the scheduler, so a bad request raises ``ValueError`` and leaves
    running requests untouched; every way a request ends (stop, length, stop
    string, abort) frees its blocks.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch_dtype(config.dtype)
        # This process is rank 0 of tensor parallelism (scheduler, bookkeeping,
        # sampling and shard 0). It loads its shard and plans the pool before it
        # starts the other ranks, so a size the model or the memory refuses
        # raises here with no worker process to stop.
        self.tp_size = config.tensor_parallel_size
        shard = load_model_shard(config, self.device, TensorParallelGroup(rank=0, world_size=self.tp_size))
        self.model, self.model_config, self.tokenizer = shard.model, shard.model_config, shard.tokenizer
        self.model_path = shard.path
        self.scheduler_config = shard.scheduler_config
        self.max_model_len = self.scheduler_config.max_model_len
        self.pool_plan = plan_kv_pool(config, self.model, self.scheduler_config, self.device)
        self.bytes_per_token = self.pool_plan.bytes_per_token
        self.executor = self._start_tensor_parallel()

        kv_cache_dtype = config.cache.kv_cache_dtype
        block_size, num_blocks = self.pool_plan.block_size, self.pool_plan.num_blocks
        num_swap_blocks = self.pool_plan.num_swap_blocks
        self._create_kv_cache_manager(num_blocks, block_size, num_swap_blocks)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.eos_token_ids = self._eos_token_ids()
        if self.executor is not None:
            self.executor.send_pool_shape(PoolShape(num_blocks, num_swap_blocks))
        self.runner = ModelRunner(
            self.model, num_blocks, block_size, self.device, dtype, self.eos_token_ids, num_swap_blocks,
            kv_cache_dtype, broadcast_step=self.executor.broadcast_step if self.executor is not None else None,
        )
        self.vocab_size = self.model_config.vocab_size
        self._rng = random.Random(config.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)
        self.beam_search = BeamSearchManager(self.scheduler, self.tokenizer)
        self._request_counter = 0
        self.num_steps = 0
        self.num_scheduled_sequences = 0
        self.peak_running_per_step = 0  # most sequences in one forward pass
        self.num_batched_tokens = 0  # tokens through the forward, summed over steps
        self.reset_step_timings()
        logger.info(self.capacity_line())
        # The model, tokenizer and pools are long-lived: move them out of the
        # garbage collector's view so its passes during generation stay short.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------- set-up

    def _start_tensor_parallel(self) -> DistributedExecutor | None:
        """Start ranks 1..N-1 (or wait for them, with ``distributed_init_method``);
        None with one rank. The workers stop when the engine goes away, even
        without ``shutdown()``."""
        if self.tp_size == 1:
            return None
        executor = DistributedExecutor(self.config, self.tp_size, self.device.type)
        self._finalizer = weakref.finalize(self, executor.shutdown)
        # The ranks share the machine's cores rather than each taking all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.tp_size))
        return executor

    def _create_kv_cache_manager(self, num_blocks: int, block_size: int, num_swap_blocks: int) -> None:
        """Set ``self.kv_cache_manager``: the block bookkeeping over the planned
        pool, paged or the contiguous baseline."""
        config = self.config
        if config.cache.kv_layout == "contiguous":
            reservation = config.cache.contiguous_reservation
            tokens = {"max_model_len": self.max_model_len, "request": None}.get(reservation, reservation)
            self.kv_cache_manager = ContiguousKVCacheManager(num_blocks, block_size, tokens)
        else:
            self.kv_cache_manager = KVCacheManager(
                num_blocks,
                block_size,
                config.cache.enable_block_sharing,
                config.cache.enable_prefix_caching,
                num_swap_blocks,
            )

    def _eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        return sorted(ids)

    def reset_step_timings(self) -> None:
        """Seconds spent per phase of step(), for the benchmarks' split."""
        self.step_timings = {"bookkeeping": 0.0, "input preparation": 0.0, "forward": 0.0, "sampling": 0.0}

    def capacity_line(self) -> str:
        """The start-up description of the KV pool (the CLI and the server print it)."""
        return self.pool_plan.capacity_line()

    def kv_pool_snapshot(self) -> dict:
        """The block pool as data: every block (state, ref count, owners, hashed)
        and the counters a live view shows next to it."""
        stats = self.stats()
        queries = stats["prefix_cache_queries"]
        return {
            "num_blocks": stats["num_blocks"],
            "block_size": stats["block_size"],
            "kv_layout": self.config.cache.kv_layout,
            "blocks": self.kv_cache_manager.pool_snapshot(),
            "counters": {
                "blocks_in_use": stats["num_blocks_in_use"],
                "cached_blocks": stats["num_cached_blocks"],
                "free_blocks": stats["num_free_blocks"],
                "usage": stats["num_blocks_in_use"] / stats["num_blocks"],
                "prefix_cache_hit_rate": stats["prefix_cache_hits"] / queries if queries else 0.0,
                "num_preemptions": stats["num_preemptions"],
                "num_running": stats["num_running"],
                "num_waiting": stats["num_waiting"],
            },
        }

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank). Safe to call twice."""
        if self.executor is not None:
            self.executor.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request. Raises ``ValueError`` (and changes
        nothing) on an empty or too-long prompt, out-of-vocabulary token ids, a
        request that could never fit in the pool, or a reused request id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request, prompt_text = self._new_request(
            request_id, prompt, params, params.num_sequences, arrival_time, priority, cache_salt
        )
        self.scheduler.add_request(request)
        self.output_processor.add(request, prompt_text)

    def add_beam_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: BeamSearchParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a beam search; its result is one finished RequestOutput whose
        outputs are the ``beam_width`` best hypotheses, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        group = BeamGroup(
            request_id, None, [], params, self.eos_token_ids, RequestMetrics(arrival_time=time.time())
        )
        # The sampled token is ignored; the top-K distribution ranks the beams.
        sampling = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=group.num_candidates
        )
        request, group.prompt = self._new_request(
            request_id, prompt, sampling, params.beam_width, None, priority, cache_salt
        )
        group.prompt_token_ids = request.prompt_token_ids
        group.metrics.arrival_time = request.arrival_time
        self.beam_search.add(group, request)
        self.scheduler.add_request(request)

    def _new_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        num_sequences: int,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
    ) -> tuple[Request, str | None]:
        """Build a validated Request. ``cache_salt`` (argument, or a dict prompt's
        ``"cache_salt"`` key) isolates the request's prefix-cache blocks: only
        requests with the same salt share them."""
        if request_id in self.output_processor.states or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'; set it or drop priority")
        prompt_text, token_ids = self._tokenize(prompt)
        max_tokens = self._validate(token_ids, params)
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if num_sequences > 1 and self.config.cache.kv_layout == "contiguous":
            raise ValueError("n > 1, best_of and beam search need kv_layout='paged' (contiguous cannot share blocks)")
        if num_sequences > self.scheduler_config.max_num_seqs:
            raise ValueError(
                f"{num_sequences} parallel sequences (n / best_of / beam_width) exceed max_num_seqs "
                f"({self.scheduler_config.max_num_seqs}); lower them or raise max_num_seqs"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time,
            priority=priority,
            seed=seed,
            num_samples=num_sequences,
            cache_salt=cache_salt,
        )
        return request, prompt_text

    def next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter - 1)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; pass at least one character or token id")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return self._tokenize(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' (token ids) or 'prompt' (text)")
        if isinstance(prompt, Sequence):
            return None, self._token_list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _token_list(self, token_ids: Sequence[Any]) -> list[int]:
        if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check the prompt against the model and the pool; return the effective max_tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); pass at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        prompt_len = len(token_ids)
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but max_model_len is {self.max_model_len} "
                f"(prompt + at least one generated token must fit); shorten the prompt or raise max_model_len"
            )
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        kv = self.kv_cache_manager
        reservation = self.config.cache.contiguous_reservation
        if (
            self.config.cache.kv_layout == "contiguous"
            and isinstance(reservation, int)
            and prompt_len + max_tokens > reservation
        ):
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the contiguous reservation of "
                f"{reservation} tokens; lower max_tokens or raise contiguous_reservation"
            )
        needed = cdiv(prompt_len + max_tokens, kv.block_size)
        if needed > kv.num_blocks:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks but the "
                f"whole pool has {kv.num_blocks}; lower max_tokens or enlarge the pool (kv_cache_memory / num_kv_blocks)"
            )
        return max_tokens

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests now and free their blocks. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.beam_search.abort(rid):
                continue
            for sequence_id in self.output_processor.abort(rid):
                self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled batch; return the outputs of
        the requests that produced a token (``finished`` set on their last)."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            self.runner.execute(scheduler_output)  # block moves owed by preemptions or forks
            if not scheduler_output.preempted_request_ids and self.scheduler.has_unfinished_requests():
                raise RuntimeError("the scheduler could not schedule any unfinished request (this is a bug)")
            return []
        now = time.time()
        for scheduled in scheduler_output.scheduled:
            metrics = self._metrics(scheduled.request.group_id)
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        self.num_steps += 1
        self.num_scheduled_sequences += len(scheduler_output.scheduled)
        self.peak_running_per_step = max(self.peak_running_per_step, len(scheduler_output.scheduled))
        self.num_batched_tokens += scheduler_output.total_num_scheduled_tokens
        scheduled_at = time.perf_counter()
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception:
            # The pass may have left K/V half-written: its requests cannot go on,
            # and blocks registered for it in the prefix cache cannot be trusted.
            self.abort_request(sorted({s.request.group_id for s in scheduler_output.scheduled}))
            self.kv_cache_manager.reset_prefix_cache()
            raise
        for rid, (first, entries) in runner_output.prompt_logprobs.items():
            self.output_processor.store_prompt_logprobs(rid, first, entries)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        sampled = [r for r in advanced if not r.tokens_chosen_externally]
        outputs = self.output_processor.process(sampled, runner_output.sampled_logprobs, runner_output.logprobs)
        outputs += self.beam_search.on_step(advanced, runner_output.logprobs)
        if self.config.debug_invariants:
            self.check_invariants()
        timings = self.step_timings
        timings["bookkeeping"] += (scheduled_at - started) + (time.perf_counter() - scheduled_at - runner_output.elapsed_s)
        timings["input preparation"] += runner_output.timings["input preparation"]
        timings["forward"] += runner_output.timings["forward"]
        timings["sampling"] += runner_output.timings["sampling"]
        return outputs

    def _metrics(self, group_id: str) -> RequestMetrics:
        state = self.output_processor.states.get(group_id)
        return state.metrics if state is not None else self.beam_search.groups[group_id].metrics

    # --------------------------------------------------------------- stats

    def stats(self) -> dict[str, int | float]:
        kv = self.kv_cache_manager
        return {
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "num_free_blocks": kv.num_free_blocks,
            "num_blocks_in_use": kv.num_blocks_in_use,
            "peak_blocks_in_use": kv.peak_blocks_in_use,
            "token_capacity": kv.num_blocks * kv.block_size,
            "bytes_per_token": self.bytes_per_token,
            "kv_cache_dtype": self.config.cache.kv_cache_dtype,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_recomputed_tokens": self.scheduler.num_recomputed_tokens,
            "num_swapped": self.scheduler.num_swapped,
            "swap_out_blocks": kv.num_swap_out_blocks,
            "swap_in_blocks": kv.num_swap_in_blocks,
            "num_swap_blocks": kv.swap_space.num_blocks,
            # In tokens. A shared prefix shorter than one block (block_size tokens)
            # never hits: only full blocks are cached.
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_cached_blocks": kv.num_cached_blocks,
            "external_fragmentation_waits": kv.num_external_fragmentation_waits,
            "num_steps": self.num_steps,
            # Sequences in the forward pass, averaged over steps: the achieved batch size.
            "mean_running_per_step": self.num_scheduled_sequences / max(1, self.num_steps),
            "peak_running_per_step": self.peak_running_per_step,
            "num_batched_tokens": self.num_batched_tokens,
            "tensor_parallel_size": self.tp_size,
            "min_cacheable_prefix_tokens": kv.block_size,
        }

    def reset_prefix_cache(self) -> int:
        """Forget all cached blocks no request is using; returns how many."""
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` on the first broken block-manager invariant."""
        self.scheduler.check_invariants()

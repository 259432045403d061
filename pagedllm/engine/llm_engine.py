"""LLMEngine: add requests, step the batch, collect outputs.

It owns the tokenizer, the scheduler (with the KV cache manager) and the
model runner, and turns sampled token ids into text, logprobs and finish
reasons.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
import time
from collections.abc import Sequence

import torch

from pagedllm.config import EngineConfig, torch_dtype
from pagedllm.core.contiguous import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_interface import KVCacheManagerProtocol
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.beam_search import BeamGroup, BeamSearchManager, BeamSearchParams
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.logger import init_logger
from pagedllm.distributed.executor import DistributedExecutor, PoolShape
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.engine.stats_reporter import StatsReporter, metrics_context
from pagedllm.model.loader import checkpoint_dtype, generation_defaults, generation_eos_token_ids
from pagedllm.model.shard import load_model_shard
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.worker.memory import plan_kv_pool
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = init_logger(__name__)


class LLMEngine:
    """The engine core behind ``LLM`` and the server.

    Safety rules: ``add_request`` validates everything before the request
    enters the scheduler, so a bad request raises ``ValueError`` and leaves
    running requests untouched; every way a request ends (stop, length, stop
    string, abort) frees its blocks.
    """

    def __init__(self, config: EngineConfig) -> None:
        config = config.with_checkpoint_dtype(checkpoint_dtype(config.model))  # dtype auto -> the checkpoint's
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
        self.kv_cache_manager = self._create_kv_cache_manager(num_blocks, block_size, num_swap_blocks)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.eos_token_ids = self._eos_token_ids()
        if self.executor is not None:
            self.executor.send_pool_shape(PoolShape(num_blocks, num_swap_blocks))
        self.runner = ModelRunner(
            self.model, num_blocks, block_size, self.device, dtype, self.eos_token_ids, num_swap_blocks,
            kv_cache_dtype, broadcast_step=self.executor.broadcast_step if self.executor is not None else None,
            max_num_seqs=self.scheduler_config.max_num_seqs, max_model_len=self.max_model_len,
            cuda_graphs=not config.enforce_eager and self.tp_size == 1,
        )
        self.vocab_size = self.model_config.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                              self.scheduler_config, config.cache, num_blocks, config.seed,
                                              max_logprobs=config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Grammar state of guided sequences; the driver alone samples, so it lives here.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.beam_search = BeamSearchManager(self.scheduler, self.tokenizer)
        # The one registry of user requests: sampled ones by their output state,
        # beam searches by their ranking state (both carry the request's metrics).
        self.requests: dict[str, RequestState | BeamGroup] = {}
        self._request_counter = 0
        self.num_steps = 0
        self.num_scheduled_sequences = 0
        self.peak_running_per_step = 0  # most sequences in one forward pass
        self.num_batched_tokens = 0  # tokens through the forward, summed over steps
        self.reset_step_timings()
        self.default_sampling_params = self._generation_defaults()
        self.stats_reporter = StatsReporter(metrics_context(config, self.pool_plan, self.scheduler_config), self.stats)
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

    def _create_kv_cache_manager(self, num_blocks: int, block_size: int, num_swap_blocks: int) -> KVCacheManagerProtocol:
        """The block bookkeeping over the planned pool: paged, or the contiguous baseline."""
        config = self.config
        if config.cache.kv_layout == "contiguous":
            reservation = config.cache.contiguous_reservation
            tokens = {"max_model_len": self.max_model_len, "request": None}.get(reservation, reservation)
            return ContiguousKVCacheManager(num_blocks, block_size, tokens)
        return KVCacheManager(num_blocks, block_size, config.cache.enable_block_sharing,
                              config.cache.enable_prefix_caching, num_swap_blocks,
                              sliding_window=self.scheduler_config.sliding_window)

    def _eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        if self.config.generation_config == "auto":
            ids.update(generation_eos_token_ids(self.model_path))
        return sorted(ids)

    def _generation_defaults(self) -> dict:
        """vLLM's ``--generation-config auto``: the checkpoint's sampling
        defaults for requests that leave a field unset (logged once)."""
        if self.config.generation_config != "auto":
            return {}
        defaults = generation_defaults(self.model_path)
        if defaults:
            logger.info("Default sampling parameters from the model's generation_config.json: %s "
                        "(--generation-config vllm ignores them)", defaults)
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams runs with (vLLM's ``get_default_sampling_params``)."""
        return SamplingParams(**self.default_sampling_params)

    def reset_step_timings(self) -> None:
        """Seconds spent per phase of step(), for the benchmarks' split."""
        self.step_timings = {"bookkeeping": 0.0, "input preparation": 0.0, "forward": 0.0, "sampling": 0.0}

    def capacity_line(self) -> str:
        """The start-up description of the KV pool (the CLI and the server print it)."""
        return self.pool_plan.capacity_line()

    def kv_pool_snapshot(self) -> dict:
        """The block pool as data: every block (state, ref count, owners, hashed)
        and the counters a live view shows next to it."""
        kv = self.kv_cache_manager.stats()
        return {
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "kv_layout": self.config.cache.kv_layout,
            "blocks": self.kv_cache_manager.pool_snapshot(),
            "counters": {
                "blocks_in_use": kv.num_blocks_in_use,
                "cached_blocks": kv.num_cached_blocks,
                "free_blocks": kv.num_free_blocks,
                "usage": kv.usage,
                "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting,
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
        request that could never fit in the pool, a reused request id, or a
        structured-output constraint that does not compile."""
        params = params or self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._check_new_id(request_id)
        self.input_processor.check_logprobs(params)  # beam search's internal candidates are exempt
        request, prompt_text = self.input_processor.new_request(
            request_id, prompt, params, params.num_sequences, arrival_time, priority, cache_salt
        )
        grammar = self.structured_output.compile(params)  # a bad schema never reaches the scheduler
        self.scheduler.add_request(request)
        if grammar is not None:
            self.structured_output.add_sequence(request_id, grammar)
        self.requests[request_id] = self.output_processor.new_state(request, prompt_text)

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
        self._check_new_id(request_id)
        group = BeamGroup(
            request_id, None, [], params, self.eos_token_ids, RequestMetrics(arrival_time=time.time())
        )
        # The sampled token is ignored; the top-K distribution ranks the beams.
        sampling = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=group.num_candidates
        )
        request, group.prompt = self.input_processor.new_request(
            request_id, prompt, sampling, params.beam_width, None, priority, cache_salt
        )
        group.prompt_token_ids = request.prompt_token_ids
        group.metrics.arrival_time = request.arrival_time
        self.beam_search.start(group, request)
        self.scheduler.add_request(request)
        self.requests[request_id] = group

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter - 1)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests now and free their blocks. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        iteration = self.stats_reporter.begin()
        for rid in ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                for sequence_id in state.live_sequence_ids():
                    self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_ABORTED)
                self.stats_reporter.observe_abort(iteration, state)
        if iteration.finished:
            self.stats_reporter.record(iteration)
        self.structured_output.retain(self.scheduler.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_request(self, request_id: str) -> bool:
        """Whether a user request with this id is live (queued, running or being reported)."""
        return request_id in self.requests

    def get_num_unfinished_requests(self) -> int:
        """Live user requests (a request forked into n samples counts once)."""
        return len(self.requests)

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
            self.stats_reporter.record(self.stats_reporter.begin())
            return []
        user_ids = self._user_ids_of(scheduler_output)
        self._count_step(scheduler_output, user_ids)
        scheduled_at = time.perf_counter()
        try:
            grammar = self.structured_output.bitmask_for(scheduler_output)
            runner_output = self.runner.execute(scheduler_output, grammar)
            self.structured_output.accept(scheduler_output, runner_output.sampled_token_ids)
        except Exception:
            # The pass may have left K/V half-written: its requests cannot go on,
            # and blocks registered for it in the prefix cache cannot be trusted.
            self.abort_request(sorted(user_ids))
            self.kv_cache_manager.reset_prefix_cache()
            raise
        outputs = self._process_runner_output(scheduler_output, runner_output)
        self.structured_output.retain(self.scheduler.requests)
        if self.config.debug_invariants:
            self.check_invariants()
        timings = self.step_timings
        timings["bookkeeping"] += (scheduled_at - started) + (time.perf_counter() - scheduled_at - runner_output.elapsed_s)
        for phase in ("input preparation", "forward", "sampling"):
            timings[phase] += runner_output.timings[phase]
        return outputs

    def _user_ids_of(self, scheduler_output: SchedulerOutput) -> set[str]:
        sequences = self.scheduler.requests
        return {sequences[s.sequence_id].group_id for s in scheduler_output.scheduled}

    def _count_step(self, scheduler_output: SchedulerOutput, user_ids: set[str]) -> None:
        now = time.time()
        for user_id in user_ids:
            metrics = self.requests[user_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        num_scheduled = len(scheduler_output.scheduled)
        self.num_steps += 1
        self.num_scheduled_sequences += num_scheduled
        self.peak_running_per_step = max(self.peak_running_per_step, num_scheduled)
        self.num_batched_tokens += scheduler_output.total_num_scheduled_tokens

    def _process_runner_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply the sampled tokens: scheduler first (appends, forks, token-level
        stops), then text (stop strings, which the engine finishes here), then
        beam ranking. Finished user requests leave the registry."""
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            self.output_processor.store_prompt_logprobs(self.requests[request_id], first, entries)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        iteration = self.stats_reporter.begin()
        self.stats_reporter.observe_advanced(iteration, advanced, self.requests)
        sampled = [r for r in advanced if not r.tokens_chosen_externally]
        beams = [r for r in advanced if r.tokens_chosen_externally]
        processed = self.output_processor.process(
            sampled, runner_output.sampled_logprobs, runner_output.logprobs, self.requests
        )
        for sequence_id in processed.stopped_sequence_ids:
            self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_STOPPED)
        outputs = processed.outputs + self.beam_search.on_step(beams, runner_output.logprobs, self.requests)
        for output in outputs:
            if output.finished:
                self.stats_reporter.observe_output(iteration, output, self.requests.pop(output.request_id))
        self.stats_reporter.record(iteration)
        return outputs

    # --------------------------------------------------------------- stats

    def stats(self) -> dict[str, int | float | str]:
        """The public counters of ``LLM.stats()``: the KV manager's
        ``KVCacheStats``, the scheduler's counts and the engine's step totals."""
        kv = self.kv_cache_manager.stats()
        scheduler = self.scheduler
        return {
            **dataclasses.asdict(kv),
            "num_blocks_in_use": kv.num_blocks_in_use,
            "token_capacity": kv.num_blocks * kv.block_size,
            "bytes_per_token": self.bytes_per_token,
            "kv_cache_dtype": self.config.cache.kv_cache_dtype,
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "num_preemptions": scheduler.num_preemptions,
            "num_recomputed_tokens": scheduler.num_recomputed_tokens,
            "num_swapped": scheduler.num_swapped,
            "num_steps": self.num_steps,
            # Sequences in the forward pass, averaged over steps: the achieved batch size.
            "mean_running_per_step": self.num_scheduled_sequences / max(1, self.num_steps),
            "peak_running_per_step": self.peak_running_per_step,
            "num_batched_tokens": self.num_batched_tokens,
            "tensor_parallel_size": self.tp_size,
            # A shared prefix shorter than one block never hits: only full blocks are cached.
            "min_cacheable_prefix_tokens": kv.block_size,
        }

    def reset_prefix_cache(self) -> int:
        """Forget all cached blocks no request is using; returns how many."""
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` on the first broken block-manager invariant."""
        self.scheduler.check_invariants()

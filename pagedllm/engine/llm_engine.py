"""LLMEngine: add requests, step the batch, collect outputs.

It owns the tokenizer, the scheduler (with the KV cache manager) and the model
runner, and turns sampled token ids into text, logprobs and finish reasons."""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Sequence

import torch

from pagedllm.config.engine import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.counters import count_step, engine_stats, kv_pool_snapshot, weight_bytes
from pagedllm.engine.setup import (create_kv_cache_manager, create_lora, eos_token_ids_of,
                                   freeze_long_lived_objects, sampling_defaults_of)
from pagedllm.engine.beam_search import BeamSearchParams, new_beam_group
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.kv_channels import KVChannels
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_request import new_pooling_request, pooler_spec_of
from pagedllm.engine.user_request import UserRequest
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import IterationStats
from pagedllm.distributed.executor import DistributedExecutor
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.engine.stats_reporter import StatsReporter, metrics_context
from pagedllm.model.loader import checkpoint_dtype
from pagedllm.model.moe.summary import weights_line
from pagedllm.model.shard import ModelShard
from pagedllm.multimodal.processing import image_prompt_processor_for
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.spec_decode.draft_model import load_draft_model
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.worker.memory import plan_kv_pool
from pagedllm.worker.rank import RunnerPlan, build_rank
from pagedllm.worker.runner_spec import RunnerSpec
from pagedllm.worker.tp_worker import worker_main

logger = init_logger(__name__)


@dataclass
class _LaunchedStep:
    """A scheduled step whose forward has started (or, inline, finished)."""

    scheduler_output: SchedulerOutput
    user_ids: set[str]
    runner_output: Future[ModelRunnerOutput]


@dataclass
class _AppliedStep:
    """A step's tokens, applied; what is left to report."""

    sampled: list[Request]  # sequences that got tokens, of requests whose tokens stream (beams report as a group)
    own_outputs: list[RequestOutput]  # of requests that report themselves (finished beam searches)
    iteration: IterationStats


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
        # This process is rank 0 of tensor parallelism (scheduler, bookkeeping,
        # sampling and shard 0), built as every rank is (``build_rank``). Its plan
        # (``_plan_runner``) sizes the pool from the loaded shard before it starts
        # the other ranks, so a size the model or the memory refuses raises here
        # with no worker process to stop.
        self.tp_size = config.tensor_parallel_size
        group = TensorParallelGroup(rank=0, world_size=self.tp_size)
        self.runner = build_rank(config, self.device, group, self._plan_runner)
        plan = self.pool_plan
        self.kv_channels = KVChannels(config, self.runner, self.model_path, plan.block_size)
        self.kv_tiers = self.kv_channels.tiers
        self.kv_cache_manager = create_kv_cache_manager(config.cache, plan, self.scheduler_config, self.kv_channels,
                                                        config.lora)
        # LoRA: adapters checked by name (registry), paged into the pool by the KV manager as requests are admitted.
        self.adapter_registry = create_lora(config, self.model_config, self.runner, self.kv_cache_manager)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.vocab_size = self.model_config.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                              self.scheduler_config, config.cache, plan.num_blocks, config.seed,
                                              max_logprobs=config.max_logprobs, adapters=self.adapter_registry,
                                              tail_blocks=plan.tail_blocks_per_request,
                                              multimodal=image_prompt_processor_for(self.model_config, self.model_path,
                                                                                         config.multimodal))
        self.output_processor = OutputProcessor(self.tokenizer)
        # Grammar state of guided sequences; the driver alone samples, so it lives here.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # The one registry of user requests: sampled ones by their output state,
        # beam searches by their ranking state (``UserRequest``s, with the request's metrics).
        self.requests: dict[str, UserRequest] = {}
        self._request_counter = self.num_steps = self.num_scheduled_sequences = 0
        self.peak_running_per_step = 0  # most sequences in one forward pass
        self.num_batched_tokens = 0  # tokens through the forward, summed over steps
        self.reset_step_timings()
        # async_scheduling: the runner's thread, and the step it runs while the last one is reported.
        self._runner_thread = ThreadPoolExecutor(1, "pagedllm-runner") if config.async_scheduling else None
        self._in_flight: _LaunchedStep | None = None
        self.default_sampling_params = sampling_defaults_of(config, self.model_path)
        self.stats_reporter = StatsReporter(metrics_context(config, self.pool_plan, self.scheduler_config), self.stats)
        logger.info(self.capacity_line())
        logger.info(weights_line(self.model, self.weight_bytes()))
        freeze_long_lived_objects()

    # ------------------------------------------------------------- set-up

    def _plan_runner(self, shard: ModelShard) -> RunnerPlan:
        """Rank 0's runner plan, once its shard is loaded: size the pool, start the other
        ranks and send them the spec every rank's runner is built from."""
        self.model, self.model_config, self.tokenizer = shard.model, shard.model_config, shard.tokenizer
        self.model_path = shard.path
        self.scheduler_config = shard.scheduler_config
        self.max_model_len = self.scheduler_config.max_model_len
        config = self.config
        self.draft_model = load_draft_model(config, self.model_config.vocab_size, self.max_model_len, self.device)
        self.pool_plan = plan_kv_pool(config, self.model, self.scheduler_config, self.device, self.draft_model)
        self.bytes_per_token = self.pool_plan.bytes_per_token
        self.executor = self._start_tensor_parallel()
        self.eos_token_ids = eos_token_ids_of(self.tokenizer, self.model_config, config, self.model_path)
        self.runner_spec = RunnerSpec.from_plan(self.pool_plan, config, self.scheduler_config,
                                               self.model.config.num_hidden_layers)
        if self.executor is not None:
            self.executor.send_runner_spec(self.runner_spec)
        # What a pooling engine's decoder pools (None: it generates); the driver alone pools.
        self.pooler_spec = pooler_spec_of(config.pooling, self.model_config, self.tokenizer, self.model_path)
        return RunnerPlan(self.runner_spec, self.eos_token_ids, speculative_config=config.speculative,
                          broadcast_step=self.executor.broadcast_step if self.executor is not None else None,
                          draft_model=self.draft_model, pooler=self.pooler_spec)

    def _start_tensor_parallel(self) -> DistributedExecutor | None:
        """Start ranks 1..N-1 (or wait for them, with ``distributed_init_method``);
        None with one rank. They stop when the engine goes away, even without ``shutdown()``."""
        if self.tp_size == 1:
            return None
        executor = DistributedExecutor(self.config, self.tp_size, self.device.type, worker_main)
        self._finalizer = weakref.finalize(self, executor.shutdown)
        return executor

    def get_default_sampling_params(self) -> SamplingParams:  # what a request without SamplingParams runs with
        return SamplingParams(**self.default_sampling_params)

    @property
    def step_timings(self) -> dict[str, float]:  # seconds spent per phase of step(), for the benchmarks' split
        return self._step_timings

    def reset_step_timings(self) -> None:
        self._step_timings = {"bookkeeping": 0.0, "input preparation": 0.0, "forward": 0.0, "sampling": 0.0}

    def capacity_line(self) -> str:
        """The start-up description of the KV pool and its tiers (the CLI and the server print it)."""
        return self.kv_channels.describe(self.pool_plan.capacity_line())

    def kv_pool_snapshot(self) -> dict:
        """The block pool as data: every block (state, ref count, owners, hashed)
        and the counters a live view shows next to it."""
        return kv_pool_snapshot(self)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, finish the disk tier's queued writes
        and stop the event publisher. Safe to call twice."""
        if self.executor is not None:
            self.executor.shutdown()
        self.kv_channels.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_image_processor(self):  # the model's ImagePromptProcessor (None: text only)
        return self.input_processor.multimodal

    def metrics_registry(self):  # the Prometheus registry the stats reporter fills
        return self.stats_reporter.prometheus.registry

    def weight_bytes(self) -> int:
        return weight_bytes(self)

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request: sampled with ``SamplingParams`` (under
        ``lora_request``'s adapter, if any; None: the defaults), or a beam search
        with ``BeamSearchParams``, whose result is one finished RequestOutput whose
        outputs are the ``beam_width`` best hypotheses, best first, or (a pooling
        engine's only kind) a pooling request, whose result is one finished
        ``PoolingRequestOutput`` (``engine/pooling_request.py``). Raises
        ``ValueError`` (and changes nothing) on other params, an empty or too-long
        prompt, out-of-vocabulary token ids, a request that could never fit in the
        pool, a reused request id, a bad adapter (or one with a beam search), or a
        structured-output constraint that does not compile."""
        params = params or self.get_default_sampling_params()
        self._check_new_id(request_id)
        if isinstance(params, PoolingParams):
            request, state = new_pooling_request(self.input_processor, self.pooler_spec, self.model_config.hidden_size,
                                                 request_id, prompt, params, arrival_time, priority, cache_salt)
            self.scheduler.add_request(request)
            self.requests[request_id] = state
            return
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be SamplingParams, BeamSearchParams or PoolingParams, got "
                             f"{type(params).__name__}")
        if self.pooler_spec is not None:
            raise ValueError(f"this engine pools (runner='pooling'): it serves {', '.join(self.pooler_spec.tasks)} "
                             "requests (LLM.embed / classify / score / encode), not generation")
        if isinstance(params, BeamSearchParams):
            if lora_request is not None:
                raise ValueError("beam search runs on the base model: it takes no lora_request")
            request, group = new_beam_group(self.input_processor, self.eos_token_ids, request_id, prompt, params,
                                            arrival_time, priority, cache_salt)
            self.scheduler.add_request(request)
            self.requests[request_id] = group
            return
        self.input_processor.check_logprobs(params)  # beam search's internal candidates are exempt
        request, prompt_text = self.input_processor.new_request(
            request_id, prompt, params, params.num_sequences, arrival_time, priority, cache_salt,
            lora_request=lora_request,
        )
        grammar = self.structured_output.compile(params)  # a bad schema never reaches the scheduler
        self.scheduler.add_request(request)
        if grammar is not None:
            self.structured_output.add_sequence(request_id, grammar, params.structured_outputs.reasoning)
        self.requests[request_id] = self.output_processor.new_state(request, prompt_text)

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
        """Live requests, or a step in flight (its results must be collected)."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def has_request(self, request_id: str) -> bool:  # live: queued, running or being reported
        return request_id in self.requests

    def get_num_unfinished_requests(self) -> int:  # a request forked into n samples counts once
        return len(self.requests)

    # ---------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled batch; return the outputs of
        the requests that produced tokens (``finished`` set on their last).

        With ``async_scheduling`` the next step's forward is launched (on the
        runner thread) before this step's outputs are built: detokenizing,
        stop strings and RequestOutputs overlap the model. Everything the next
        schedule depends on (appended tokens, token-level stops, beam choices,
        grammar states, drafts) is applied before it; a sequence a stop string
        ends computes one more token, which is dropped."""
        started = time.perf_counter()
        launched = self._in_flight or self._launch()
        self._in_flight = None
        if launched is None:
            return []
        runner_output, waited = self._collect(launched)
        applied = self._apply(launched.scheduler_output, runner_output)
        if self._runner_thread is not None and self.scheduler.has_unfinished_requests():
            self._in_flight = self._launch()  # overlaps the reporting below
        outputs = self._report(applied, runner_output)
        timings = self.step_timings
        inline_s = runner_output.elapsed_s if self._runner_thread is None else 0.0
        timings["bookkeeping"] += time.perf_counter() - started - waited - inline_s
        for phase in ("input preparation", "forward", "sampling"):
            timings[phase] += runner_output.timings[phase]
        return outputs

    def _launch(self) -> _LaunchedStep | None:
        """Schedule a step and start its forward (inline without async
        scheduling); None when nothing was scheduled (its block moves are done)."""
        scheduler_output = self.scheduler.schedule()
        self.kv_channels.publish()
        if scheduler_output.is_empty:
            self.runner.execute(scheduler_output)  # block moves owed by preemptions, forks or tiers
            stuck = not scheduler_output.preempted_request_ids and self.scheduler.has_unfinished_requests()
            if stuck and not self.kv_channels.wait_for_disk():  # (a prefix from disk is worth the wait)
                raise RuntimeError("the scheduler could not schedule any unfinished request (this is a bug)")
            self.stats_reporter.record(self.stats_reporter.begin())
            return None
        user_ids = count_step(self, scheduler_output)
        grammar = self.structured_output.bitmask_for(scheduler_output)
        if self._runner_thread is not None:
            return _LaunchedStep(scheduler_output, user_ids,
                                 self._runner_thread.submit(self.runner.execute, scheduler_output, grammar))
        result: Future[ModelRunnerOutput] = Future()
        try:
            result.set_result(self.runner.execute(scheduler_output, grammar))
        except Exception as error:  # raised again, with the clean-up, when collected
            result.set_exception(error)
        return _LaunchedStep(scheduler_output, user_ids, result)

    def _collect(self, launched: _LaunchedStep) -> tuple[ModelRunnerOutput, float]:
        """The step's runner output, and the seconds spent waiting for it."""
        waiting = time.perf_counter()
        try:
            runner_output = launched.runner_output.result()
            self.structured_output.accept(launched.scheduler_output, runner_output.sampled)
        except Exception:
            # The pass may have left K/V half-written: its requests cannot go on,
            # and blocks registered for it in the prefix cache cannot be trusted.
            self.abort_request(sorted(launched.user_ids))
            self.kv_cache_manager.reset_prefix_cache()
            raise
        return runner_output, time.perf_counter() - waiting

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> _AppliedStep:
        """What the next schedule depends on: the scheduler appends the tokens as
        each request's policy decides (forks, token-level stops, drafts; beam
        groups pick their hypotheses' tokens)."""
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            self.output_processor.store_prompt_logprobs(self.requests[request_id], first, entries)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output)
        iteration = self.stats_reporter.begin()
        self.stats_reporter.observe_advanced(iteration, advanced, self.requests, runner_output.sampled)
        states = {request.group_id: self.requests[request.group_id] for request in advanced}
        own_outputs = [output for state in states.values() if (output := state.own_output(self.tokenizer))]
        self.structured_output.retain(self.scheduler.requests)
        if self.config.debug_invariants:
            self.check_invariants()
        sampled = [request for request in advanced if states[request.group_id].streams_tokens]
        return _AppliedStep(sampled, own_outputs, iteration)

    def _report(self, applied: _AppliedStep, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Text, stop strings (the engine finishes those sequences here) and the
        outputs; finished user requests leave the registry."""
        processed = self.output_processor.process(applied.sampled, runner_output.sampled, self.requests)
        for sequence_id in processed.stopped_sequence_ids:
            self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_STOPPED)
        outputs = processed.outputs + applied.own_outputs
        for output in outputs:
            if output.finished:
                self.stats_reporter.observe_output(applied.iteration, output, self.requests.pop(output.request_id))
        self.stats_reporter.record(applied.iteration)
        return outputs

    # --------------------------------------------------------------- stats

    def stats(self) -> dict[str, int | float | str]:
        """The public counters of ``LLM.stats()``: the KV manager's
        ``KVCacheStats``, the scheduler's counts and the engine's step totals."""
        return engine_stats(self)

    def reset_prefix_cache(self) -> int:
        """Forget the cached blocks no request uses (pool and host tier); returns how many pool blocks."""
        dropped = self.kv_cache_manager.reset_prefix_cache()
        self.kv_channels.publish()
        return dropped

    def check_invariants(self) -> None:  # RuntimeError on the first broken block-manager invariant
        self.scheduler.check_invariants()

    def reset_peak_blocks_in_use(self) -> None:  # a new stats()["peak_blocks_in_use"] from the blocks in use now
        self.kv_cache_manager.reset_peak_blocks_in_use()

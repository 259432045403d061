"""The offline ``LLM`` class: vLLM's user-facing shape over an ``EngineClient`` (``engine/client.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.client import EngineClient, make_engine_client
from pagedllm.engine.input_processor import PromptType
from pagedllm.entrypoints.pooling_api import (DecoderEngineBackend, EncoderBackend, NoEngine, PoolingBackend,
                                              PoolingMethods, as_prompt_list, encoder_runner_for)
from pagedllm.entrypoints.chat_utils import ChatRenderOptions, load_chat_template, render_chat
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.reader import Metric, get_metrics_snapshot
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM(PoolingMethods):
    """Generate text for a list of prompts with a paged-KV continuous-batching engine.

    ``model=None`` loads the embedded SmolLM2-135M-Instruct; otherwise pass a
    GGUF file or a Hugging Face checkpoint folder. The keyword options are the
    fields of ``EngineConfig`` and of its ``CacheConfig`` (``pagedllm/config/engine.py``
    documents each); an unknown one is a ``ValueError`` listing them all. The
    pool is sized by ``num_kv_blocks`` (exact), ``kv_cache_memory`` (bytes) or
    ``kv_cache_fraction`` (of available memory after weights), in that order;
    otherwise on CUDA by ``gpu_memory_utilization`` (vLLM's meaning, 0.9 by
    default) and on CPU 2 GiB; with ``tensor_parallel_size`` > 1 the budget is
    per rank (each rank holds 1/N of the KV heads of every block).

    ``engine_process=True`` runs the engine core (scheduler, runner, outputs) in
    a process of its own, as ``pagedllm serve`` does; this object then talks to
    it over ZMQ (``engine/core_proxy.py``). The results are the same.

    ``data_parallel_size=N`` (> 1) starts N engine-core processes, each with its
    own pool built from the same options (``engine_process`` is implied; an unset
    ``num_threads`` gives each cores // (N x tensor_parallel_size) threads).
    ``generate``, ``chat`` and ``beam_search`` split their prompts among them,
    prompts sharing a prefix to the same replica, the prompt tokens balanced
    (``fleet/offline.py``); the outputs come back in prompt order. The other
    methods' answers with N > 1 are in their docstrings.

    ``runner="pooling"`` makes a pooling LLM (``embed``, ``classify``, ``score``,
    ``encode``: ``entrypoints/pooling_api.py``; docs/pooling.md): a decoder's
    requests go through the engine, its pool and prefix cache (with
    ``data_parallel_size`` > 1, each to the replica the fleet routes it to); an encoder-only
    checkpoint runs on the encoder runner, without an engine.
    """

    def __init__(self, model: str | None = None, *, engine_process: bool = False, data_parallel_size: int = 1,
                 **options: Any) -> None:
        self._pooling_backend: PoolingBackend | None = None
        encoder = encoder_runner_for(model, options)
        if encoder is not None:  # an encoder-only checkpoint: pooled without an engine or KV blocks
            self.llm_engine: EngineClient = NoEngine(encoder.tokenizer)
            self._pooling_backend = EncoderBackend(encoder)
            return
        self.llm_engine = make_engine_client({"model": model, **options}, engine_process=engine_process,
                                             data_parallel_size=data_parallel_size)

    @property
    def pooling_backend(self) -> PoolingBackend:
        """What ``embed`` / ``classify`` / ``score`` / ``encode`` run on: the engine, or an encoder runner."""
        if self._pooling_backend is None:
            self._pooling_backend = DecoderEngineBackend(self.llm_engine, self._drive)
        return self._pooling_backend

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (a no-op with one rank) and the
        engine-core process(es). They also stop when the program exits."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def stats(self) -> dict[str, int | float]:
        """The engine's counters (blocks, prefix-cache hits, steps...). With
        ``data_parallel_size`` > 1: summed over the replicas, except the per-replica
        constants (block_size, bytes_per_token, ...) given once, peak_running_per_step
        (the largest) and mean_running_per_step (recomputed); plus data_parallel_size."""
        return self.llm_engine.stats()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without SamplingParams: vLLM's defaults,
        overridden by the checkpoint's generation_config.json (unless
        ``generation_config="vllm"``)."""
        return self.llm_engine.get_default_sampling_params()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as vLLM's ``LLM.get_metrics()``: one
        Counter / Gauge / Histogram object (name, labels, value) per series,
        named as on the server's /metrics (``pagedllm:`` prefix). With
        ``data_parallel_size`` > 1 every replica's series, labelled ``engine`` = its index."""
        return get_metrics_snapshot(self.llm_engine.metrics_registry())

    def kv_pool_snapshot(self) -> dict:
        """Every KV block's state ("used", "cached", "free"), ref count, owning
        request ids and whether it is hashed, plus usage, hit-rate and
        preemption counters: the data behind the server's /v1/kv_pool. With
        ``data_parallel_size`` > 1: ``{"data_parallel_size": N, "replicas": [one snapshot each]}``."""
        return self.llm_engine.kv_pool_snapshot()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no running request uses; returns how many
        (over all replicas with ``data_parallel_size`` > 1)."""
        return self.llm_engine.reset_prefix_cache()

    def reset_peak_blocks_in_use(self) -> None:
        """Start a new ``stats()["peak_blocks_in_use"]`` measurement from the blocks
        in use now (so a benchmark reads one workload's peak); on every replica."""
        self.llm_engine.reset_peak_blocks_in_use()

    def step_timings(self) -> dict[str, float]:
        """Seconds the engine's steps spent per phase ("bookkeeping", "input
        preparation", "forward", "sampling") since it started or since
        ``reset_step_timings()``: a copy, in that order (summed over replicas)."""
        return dict(self.llm_engine.step_timings)

    def reset_step_timings(self) -> None:
        """Zero the ``step_timings()`` counters (e.g. after a warm-up request)."""
        self.llm_engine.reset_step_timings()

    def weight_bytes(self) -> int:
        """Bytes this process holds for the model's parameters and buffers (a tensor
        tied to another counted once, packed GGUF weights at their packed size);
        with tensor parallelism, rank 0's shard; with data parallelism, summed over
        the replicas' processes."""
        return self.llm_engine.weight_bytes()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.
        ``lora_request``: one adapter for every prompt, or one (or None: the base)
        per prompt; the engine needs ``enable_lora=True``.

        A bad prompt raises ``ValueError`` before any step runs: the prompts
        already queued by this call are withdrawn, so nothing of it runs and no
        block stays taken.
        """
        prompt_list = as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; pass one or one per prompt"
                )
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompt_list)} prompts; pass one or one per prompt")
        return self._drive(
            prompt_list,
            lambda engine, rid, prompt, i: engine.add_request(rid, prompt, params_list[i], priority=priorities[i],
                                                              lora_request=loras[i]),
            use_tqdm,
        )

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate (vLLM's ``LLM.chat``).

        Messages are OpenAI's (assistant ``tool_calls``, ``role: "tool"`` results
        with ``tool_call_id``). ``tools`` (OpenAI's ``{"type": "function", ...}``)
        and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) go to the
        template, which must read them; ``image_url`` content parts (data URLs, or by the
        engine's media options) go to a vision-language model's processor;
        ``continue_final_message`` continues the final assistant message instead of opening a new one (set
        ``add_generation_prompt=False`` with it). ``chat_template`` overrides the
        model's: a file path, inline Jinja or ``"hermes"`` (the shipped tool
        template). The output is not parsed for tool calls: use
        ``pagedllm.entrypoints.openai.tool_parsers.HermesToolParser`` on the text.
        Raises ``ValueError`` naming the argument to change.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        options = ChatRenderOptions(
            tools=tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=load_chat_template(chat_template), chat_template_kwargs=chat_template_kwargs,
        )
        prompts: list[PromptType] = []
        for conversation in conversations:
            prompt = render_chat(tokenizer, list(conversation), options, self.llm_engine.get_image_processor())
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's shape). Hypotheses share their
        common prefix blocks; each output lists ``beam_width`` sequences (prompt
        + generated tokens), best score first."""
        prompt_list = as_prompt_list(prompts)
        finished = self._drive(
            prompt_list, lambda engine, rid, prompt, i: engine.add_request(rid, prompt, params), use_tqdm
        )
        results = []
        for out in finished:
            results.append(
                BeamSearchOutput(
                    [
                        BeamSearchSequence(
                            tokens=out.prompt_token_ids + c.token_ids,
                            text=c.text,
                            cum_logprob=c.cumulative_logprob,
                            score=c.cumulative_logprob / len(c.token_ids) ** params.length_penalty,
                            finish_reason=c.finish_reason,
                        )
                        for c in out.outputs
                    ]
                )
            )
        return results

    def _drive(self, prompts: list[PromptType], add, use_tqdm: bool) -> list[RequestOutput]:
        """Queue every prompt with ``add(engine, request_id, prompt, index)``, step
        until all finish, and return the final outputs in prompt order (with
        ``data_parallel_size`` > 1 the fleet routes each to a replica and steps them all)."""
        engine = self.llm_engine
        request_ids = [engine.next_request_id() for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        try:
            for i, rid in enumerate(request_ids):
                add(engine, rid, prompts[i], i)
            with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        finally:
            # On any error (bad prompt midway, interrupt, a dead core) nothing stays queued or holds blocks.
            engine.abort_request([rid for rid in request_ids if rid not in finished])
        return [finished[rid] for rid in request_ids]

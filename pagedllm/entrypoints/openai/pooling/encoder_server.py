"""Serving an encoder-only checkpoint: no engine, no KV pool, one batching service.

``EncoderBatcher`` gathers the inputs of the requests that arrive while a batch
runs and hands them all to one ``EncoderPoolingRunner.run`` call in a worker
thread (the runner packs them by its token budget, without padding), so
concurrent clients share batches as ``LLM.embed``'s one call does.
``EncoderEngineClient`` stands where the server expects an engine client: the
admin routes keep working (/health: the batcher runs; /v1/models; /metrics: the
batcher's counters), /v1/kv_pool is a 404 saying the model has no block pool, and
a generation is refused (the app's runner guard answers it first)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

from pagedllm.config.pooling import PoolerSpec
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.entrypoints.openai.common.errors import APIError
from pagedllm.entrypoints.openai.pooling.service import START_POOLING
from pagedllm.entrypoints.pooling_api import PooledResult, encoder_inputs, run_encoder
from pagedllm.entrypoints.pooling_inputs import PooledPrompt

_Pending = tuple[list[PooledPrompt], asyncio.Future]


class EncoderBatcher:
    """The pooling service of an encoder server (``service.PoolingService``).

    Safety rule: ``start()`` on the server's event loop before ``run``; the runner is
    only ever called from one worker thread at a time (the loop awaits each batch)."""

    def __init__(self, runner: Any, registry: CollectorRegistry) -> None:
        self.runner = runner
        self.inputs = encoder_inputs(runner, START_POOLING)
        self._pending: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.requests = Counter("pagedllm:pooling_requests", "Pooling requests served", registry=registry)
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Input tokens pooled", registry=registry)
        self.batches = Counter("pagedllm:encoder_batches", "Runner calls (each one batch)", registry=registry)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._wakeup = asyncio.Event()  # bound to the running loop
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self, inputs: list[PooledPrompt], cache_salt: str | None) -> list[PooledResult]:
        """One result per input, in order, from the batch this request joins
        (``cache_salt`` is moot: an encoder caches nothing)."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((inputs, future))
        self._wakeup.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch, self._pending = self._pending, []
                await self._run_batch([item for item in batch if not item[1].done()])

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """One runner call for every input of ``batch``; on a failure each request runs
        alone, so only the one at fault gets its error."""
        if not batch:
            return
        try:
            outputs = await asyncio.to_thread(self._pool, [item for inputs, _ in batch for item in inputs])
        except Exception as exc:  # the runner refused an input: find whose
            if len(batch) > 1:
                for one in batch:
                    await self._run_batch([one])
            elif not batch[0][1].done():
                batch[0][1].set_exception(APIError(400, str(exc)) if isinstance(exc, ValueError) else exc)
            return
        start = 0
        for inputs, future in batch:
            if not future.done():
                future.set_result(outputs[start:start + len(inputs)])
            start += len(inputs)
            self.requests.inc()
            self.prompt_tokens.inc(sum(len(item.token_ids) for item in inputs))

    def _pool(self, inputs: list[PooledPrompt]) -> list[PooledResult]:
        results = run_encoder(self.runner, inputs)
        self.batches.inc()
        return [PooledResult(f"pool-{next(self._ids)}", data) for data in results]


class EncoderEngineClient:
    """The ``AsyncEngineClient`` of an encoder server: its ``pooling`` batcher, and the
    engine's admin surface answered for a model without an engine or a pool."""

    def __init__(self, runner: Any) -> None:
        self.registry = CollectorRegistry()
        self.pooling = EncoderBatcher(runner, self.registry)
        tokenizer = runner.tokenizer
        self.info = EngineInfo(tokenizer=tokenizer, max_model_len=runner.max_model_len, vocab_size=len(tokenizer),
                               eos_token_ids=(), max_num_seqs=1, max_logprobs=0, scheduling_policy="fcfs",
                               default_sampling_params={}, pooler_spec=PoolerSpec(tuple(runner.supported_tasks)))
        self._ids = itertools.count()

    @property
    def is_running(self) -> bool:
        return self.pooling.is_running

    def start(self) -> None:
        self.pooling.start()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        return None  # the runner loaded before this client was made

    async def stop(self) -> None:
        await self.pooling.stop()

    def shutdown(self) -> None:
        return None  # nothing runs outside this process's event loop

    def next_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("this server pools with an encoder-only model: it serves /v1/embeddings, /score, /rerank, "
                         "/classify and /pooling; generate with a decoder, started without --runner pooling")

    def abort(self, request_id: str) -> None:
        return None  # requests run whole in a batch: nothing to stop

    def end_all_requests(self) -> int:
        return 0

    async def reset_prefix_cache(self) -> int:
        return 0  # no prefix cache

    async def kv_pool_snapshot(self) -> dict:
        raise APIError(404, "this server runs an encoder-only model, which takes no KV blocks: it has no block pool",
                       code="no_kv_pool")

    async def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    def compile_structured_outputs(self, params: Any) -> None:
        raise ValueError("an encoder-only model generates nothing to constrain")

    async def add_lora(self, lora_request: Any) -> str:
        raise ValueError("an encoder-only model takes no LoRA adapters")

    async def remove_lora(self, lora_name: str) -> bool:
        return False

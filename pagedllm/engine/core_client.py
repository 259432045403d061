"""The API side of the engine-core process: the server's ``AsyncEngineCoreClient``
and the offline ``EngineCoreProxy`` (``LLM(engine_process=True)``).

Both talk to the core over a ZMQ DEALER socket (``core_messages``), tokenize
prompts here (the core receives token ids), fold the core's output deltas
back into RequestOutputs, and notice a dead core: its ``EngineFailed``
message, or its process gone (checked every ``LIVENESS_INTERVAL_S``).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import time
import uuid
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import psutil
import zmq
import zmq.asyncio

from pagedllm.core.prompt_tokens import tokenized
from pagedllm.multimodal.wire import features_to_wire
from pagedllm.engine.async_engine import EngineDeadError, RequestStream, end_requests
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.core_messages import (AbortRequests, AddRequest, AddResult, EngineFacts, EngineFailed, Hello,
                                           OutputBatch, Ready, RequestError, RequestsDropped, UtilityCall,
                                           UtilityResult, input_codec, output_codec)
from pagedllm.lora.request import LoRARequest
from pagedllm.engine.core_process import EngineCoreProcess, metrics_address
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.output_deltas import OutputAssembler
from pagedllm.engine.supervisor import Supervisor
from pagedllm.logger import init_logger
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = init_logger(__name__)

LIVENESS_INTERVAL_S = 0.25  # a dead core is noticed within this (the issue asks for a second)
_HELLO_INTERVAL_S = 0.5  # how often a client without a core says hello (a core loading or restarting)


def info_of(facts: EngineFacts, tokenizer: Any) -> EngineInfo:
    return EngineInfo(
        tokenizer=tokenizer, max_model_len=facts.max_model_len, vocab_size=facts.vocab_size,
        eos_token_ids=tuple(facts.eos_token_ids), max_num_seqs=facts.max_num_seqs, max_logprobs=facts.max_logprobs,
        scheduling_policy=facts.scheduling_policy,
        default_sampling_params=MappingProxyType(dict(facts.default_sampling_params)), pooler_spec=facts.pooler_spec,
        multimodal=None if facts.multimodal_pickle is None else pickle.loads(facts.multimodal_pickle),
    )


def add_message(info: EngineInfo, request_id: str, prompt: Any, params: SamplingParams | BeamSearchParams | PoolingParams,
                priority: int, cache_salt: str | None, lora_request: LoRARequest | None) -> AddRequest:
    """The message that adds a request to the core: its prompt tokenized (and its images
    processed: tensors as bytes) here, a beam search's params in ``beam``, a pooling
    request's in ``pooling`` (the core's engine refuses what it cannot run)."""
    beam = params if isinstance(params, BeamSearchParams) else None
    pooling = params if isinstance(params, PoolingParams) else None
    prompt = tokenized(info.tokenizer, prompt, info.multimodal)
    features = prompt.get("mm_features") if isinstance(prompt, dict) else None
    if features is not None:  # the tensors travel as bytes beside the prompt (``multimodal/wire.py``)
        prompt = {key: value for key, value in prompt.items() if key != "mm_features"}
    return AddRequest(request_id, prompt, None if beam or pooling else params, beam=beam, priority=priority,
                      cache_salt=cache_salt, lora_request=lora_request, pooling=pooling,
                      mm_features=None if features is None else features_to_wire(list(features)))


def request_error(error: RequestError) -> ValueError:
    """The exception the core's refusal stands for (a structured-output one keeps its field)."""
    if error.structured_output_kind is not None:
        from pagedllm.structured_output import StructuredOutputError

        return StructuredOutputError(error.structured_output_kind, error.structured_output_reason or "")
    return ValueError(error.message)


def _log_send_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.warning("a message to the engine core could not be sent: %r", sent.exception())


def core_process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class AsyncEngineCoreClient:
    """The server's door to an engine-core process: ``AsyncLLMEngine``'s methods.

    ``core``: the process this client launched and supervises (None when
    another process does, as with ``--api-server-count`` > 1), by the
    ``Supervisor``'s rule: with ``restart`` a core that died after it was
    ready is started again, and the client serves again once it is ready;
    otherwise ``on_core_exit`` is called once (the server stops with status 1).
    A core that exits before its first ``Ready`` is ``wait_ready``'s load failure.

    Safety rules: call ``start()`` from the running event loop, then await
    ``wait_ready()`` before anything else; a consumer that stops reading a
    stream early must ``abort()`` it (``RequestStream``'s rule)."""

    def __init__(self, address: str, core: EngineCoreProcess | None = None, restart: bool = False,
                 on_core_exit: Callable[[int | None], None] | None = None, name: str = "api") -> None:
        self.address = address
        self.core = core
        self.supervisor = None if core is None else Supervisor(
            core, "the engine core", restart, on_core_exit or (lambda exitcode: None))
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}".encode()
        self.info: EngineInfo | None = None
        self.dead_error: BaseException | None = None
        self._core_pid: int | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._adds: dict[str, asyncio.Future[AddResult]] = {}
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count()
        self._assembler = OutputAssembler()
        self._encoder, _ = input_codec()
        _, self._decoder = output_codec()
        self._ids = 0
        self._tasks: list[asyncio.Task] = []
        self._socket: zmq.asyncio.Socket | None = None
        self._ready: asyncio.Event | None = None
        self._structured = None  # a grammar compiler of this process, made on first use

    # ------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        """The core answered and has not died since (what /health reports)."""
        return self.info is not None and self._core_pid is not None and self.dead_error is None

    def start(self) -> None:
        if self._socket is not None:
            return
        self._ready = asyncio.Event()
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive_loop()), loop.create_task(self._watch_loop())]

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the core has answered; raises ``RuntimeError`` when the core
        this client launched exits first (the model did not load)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready.is_set():
            if self.core is not None and self.core.exitcode is not None:  # (restarts are of a core once ready)
                raise RuntimeError(f"the engine-core process exited with status {self.core.exitcode} before it "
                                   "was ready (see its error in the log above)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine core did not answer within {timeout_s} s")
            try:
                await asyncio.wait_for(self._ready.wait(), LIVENESS_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def shutdown(self) -> None:
        """Stop the core this client launched (it finishes the disk tier's writes)."""
        if self.core is not None:
            self.core.shutdown()

    # ------------------------------------------------------------- requests

    def next_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self.identity.decode()}-{self._ids}"

    async def add_request(self, request_id: str, prompt: Any,
                          params: SamplingParams | BeamSearchParams | PoolingParams, *,
                          priority: int = 0, cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request in the core (raises ``ValueError`` as ``LLMEngine.add_request``
        does, once the core has checked it) and return the stream of its outputs."""
        message = add_message(self.info, request_id, prompt, params, priority, cache_salt, lora_request)
        return RequestStream(request_id, await self._add(message), self.abort)

    async def _add(self, message: AddRequest) -> asyncio.Queue:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core is not running ({self.dead_error}); retry later")
        request_id = message.request_id
        answer: asyncio.Future[AddResult] = asyncio.get_running_loop().create_future()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._adds[request_id] = answer
        self._streams[request_id] = queue  # outputs may follow the answer in the same read
        try:
            await self._socket.send(self._encoder.encode(message))
            result = await answer
        except BaseException:  # a client that left while the core had not answered yet
            if self._streams.pop(request_id, None) is not None and self.dead_error is None:
                self._send_soon(AbortRequests([request_id]))
            raise
        finally:
            self._adds.pop(request_id, None)
        if result.error is not None:
            self._streams.pop(request_id, None)
            raise request_error(result.error)
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream gets nothing more and the core frees its
        blocks before its next step. Idempotent."""
        if self._streams.pop(request_id, None) is None:
            return
        self._assembler.forget(request_id)
        if self._socket is not None and self.dead_error is None:
            self._send_soon(AbortRequests([request_id]))

    def end_all_requests(self) -> int:
        """End every request in flight, each stream with a last output finished
        "abort" (``end_requests``: a shutdown past its deadline); how many."""
        return end_requests(self._streams, self.abort)

    def _send_soon(self, message: Any) -> None:
        """Send from code that cannot wait (an abort): zmq queues it; a failure is logged."""
        sent = self._socket.send(self._encoder.encode(message))
        sent.add_done_callback(_log_send_failure)

    def compile_structured_outputs(self, params: SamplingParams) -> None:
        """Check ``params``' constraint here, with this process's own compiler
        (``StructuredOutputError`` naming the field); the core compiles it again."""
        if params.structured_outputs is None:
            return
        if self._structured is None:
            from pagedllm.structured_output import StructuredOutputManager

            self._structured = StructuredOutputManager(self.info.tokenizer, self.info.vocab_size,
                                                       list(self.info.eos_token_ids))
        self._structured.compile(params)

    # ------------------------------------------------------- utility calls

    async def call(self, method: str, *args: Any) -> Any:
        """Run a ``core_process.UTILITY_METHODS`` call in the core, between its steps."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core is not running ({self.dead_error}); retry later")
        call_id = next(self._call_ids)
        answer: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        try:
            await self._socket.send(self._encoder.encode(UtilityCall(call_id, method, list(args))))
            result = await answer
        finally:
            self._calls.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(f"engine call {method} failed: {result.error}")
        return result.value

    async def reset_prefix_cache(self) -> int:
        return await self.call("reset_prefix_cache")

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """Check an adapter in the core now (``ValueError`` naming the problem, as in-process);
        its fingerprint."""
        return await self._refusable_call("add_lora", lora_request.lora_name, lora_request.lora_int_id,
                                   lora_request.lora_path)

    async def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter in the core (``lora_admin.remove_lora``); False if it does not know it."""
        return await self._refusable_call("remove_lora", lora_name)

    async def _refusable_call(self, method: str, *args: Any) -> Any:
        """A utility call whose refusal comes back as data (``value_or_refusal``), raised here as the
        ``ValueError`` the in-process engine raises."""
        value, refusal = await self.call(method, *args)
        if refusal is not None:
            raise ValueError(refusal)
        return value

    async def kv_pool_snapshot(self) -> dict:
        return await self.call("kv_pool_snapshot")

    async def metrics_text(self) -> bytes:
        """The core's metrics in Prometheus' text format, from its metrics thread
        (answered during a step too)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core is not running ({self.dead_error}); retry later")
        socket = zmq.asyncio.Context.instance().socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(metrics_address(self.address))
        try:
            await socket.send(b"")
            return await asyncio.wait_for(socket.recv(), 10.0)
        finally:
            socket.close()

    # ---------------------------------------------------------------- loops

    async def _receive_loop(self) -> None:
        while True:
            payload = await self._socket.recv()
            try:
                self._dispatch(self._decoder.decode(payload))
            except Exception:  # one bad message must not stop every stream of this server
                logger.exception("a message from the engine core could not be handled")

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, OutputBatch):
            for delta in message.outputs:
                queue = self._streams.get(delta.request_id)
                if queue is None:
                    self._assembler.forget(delta.request_id)  # aborted here; the core hears of it soon
                    continue
                output = self._assembler.assemble(delta)
                queue.put_nowait(output)
                if output.finished:
                    del self._streams[delta.request_id]
        elif isinstance(message, AddResult):
            answer = self._adds.get(message.request_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, UtilityResult):
            answer = self._calls.get(message.call_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, Ready):
            self._on_ready(message.facts)
        elif isinstance(message, EngineFailed):
            self._die(EngineDeadError(message.message))
        elif isinstance(message, RequestsDropped):  # a 503 like a dead core's: they cannot finish
            self._fail_streams(message.request_ids, f"dropped by the engine core: {message.reason}")

    def _on_ready(self, facts: EngineFacts) -> None:
        if facts.pid == self._core_pid:
            return  # an answer to a repeated hello
        if self.info is None:
            self.info = info_of(facts, pickle.loads(facts.tokenizer_pickle))
        elif self.dead_error is not None:
            logger.info("the engine core (pid %d) is ready again: serving", facts.pid)
        self._core_pid = facts.pid
        self.dead_error = None
        if self.supervisor is not None:
            self.supervisor.ready()
        self._ready.set()

    async def _watch_loop(self) -> None:
        """Say hello until a core answers; then check every interval that it lives.
        The core this client launched is supervised once it was first ready (before
        that, its exit is ``wait_ready``'s load failure)."""
        last_hello = 0.0
        while True:
            now = time.monotonic()
            if self._core_pid is None and now - last_hello >= _HELLO_INTERVAL_S:
                await self._socket.send(self._encoder.encode(Hello(self.identity.decode())))
                last_hello = now
            elif self._core_pid is not None and not core_process_alive(self._core_pid):
                self._core_pid = None
                self._die(EngineDeadError("the engine-core process died; see the server log"))
            if self.supervisor is not None and self.info is not None and not self.supervisor.check():
                return
            await asyncio.sleep(LIVENESS_INTERVAL_S)

    def _die(self, error: EngineDeadError) -> None:
        """Fail every open stream, pending add and call with ``error``; the client
        refuses new work until a core is ready again."""
        if self.dead_error is None:
            logger.error("%s", error)
        self.dead_error = error
        self._fail_streams(list(self._streams), f"failed: {error}")
        for future in (*self._adds.values(), *self._calls.values()):
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))

    def _fail_streams(self, request_ids: list[str], why: str) -> None:
        """End these requests' streams with ``EngineDeadError`` (the server's 503)."""
        for request_id in request_ids:
            self._assembler.forget(request_id)
            queue = self._streams.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(EngineDeadError(f"request {request_id} {why}"))

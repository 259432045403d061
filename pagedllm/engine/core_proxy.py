"""``LLM(engine_process=True)``: the offline API over an engine-core process.

``EngineCoreProxy`` answers the ``LLMEngine`` methods ``LLM`` uses, blocking,
over the core's socket: requests are added (and refused) as in-process, and
``step()`` returns the outputs of the core's next step. Everything that reads
the pool or the counters is a utility call the core runs between steps.
"""

from __future__ import annotations

import itertools
import pickle
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from pagedllm.config.pooling import PoolerSpec
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.core_client import (LIVENESS_INTERVAL_S, add_message, core_process_alive, info_of,
                                         request_error)
from pagedllm.engine.core_messages import (AbortRequests, AddRequest, AddResult, EngineFailed, Hello, OutputBatch,
                                           Ready, RequestsDropped, UtilityCall, UtilityResult, input_codec,
                                           output_codec)
from pagedllm.lora.request import LoRARequest
from pagedllm.engine.core_process import CoreLaunch, EngineCoreProcess
from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.engine.output_deltas import OutputAssembler
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class _RemoteRegistry:
    """A metrics registry read from the core's text exposition (what ``get_metrics_snapshot`` walks)."""

    def __init__(self, text: str) -> None:
        self._text = text

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        return text_string_to_metric_families(self._text)


class EngineCoreProxy:
    """The engine of an ``LLM`` whose core runs in another process.

    Safety rules: one thread uses it (``LLM``'s); ``shutdown()`` stops the core
    (it also stops when this process exits)."""

    def __init__(self, engine_options: dict[str, Any], ready_timeout_s: float = 600.0) -> None:
        self.core = EngineCoreProcess(CoreLaunch(engine_options, CoreLaunch.new_address()))
        self.core.start()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.core.launch.address)
        self._encoder, _ = input_codec()
        _, self._decoder = output_codec()
        self._assembler = OutputAssembler()
        self._live: set[str] = set()
        self._early: deque[OutputBatch] = deque()  # outputs that arrived while waiting for an answer
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        facts = self._handshake(ready_timeout_s)
        self.pid = facts.pid
        self.info = info_of(facts, pickle.loads(facts.tokenizer_pickle))
        self._capacity_line = facts.capacity_line

    def _handshake(self, timeout_s: float):
        waited = 0.0
        while waited < timeout_s:
            if self.core.exitcode is not None:
                self.shutdown()
                raise RuntimeError(f"the engine-core process exited with status {self.core.exitcode} while "
                                   "loading (its error is in the log above)")
            self._send(Hello("llm"))
            if self._socket.poll(int(LIVENESS_INTERVAL_S * 4000)):
                message = self._decoder.decode(self._socket.recv())
                if isinstance(message, Ready):
                    return message.facts
            waited += LIVENESS_INTERVAL_S * 4
        self.shutdown()
        raise TimeoutError(f"the engine core did not answer within {timeout_s} s")

    # ---------------------------------------------------------- plumbing

    def _send(self, message: Any) -> None:
        self._socket.send(self._encoder.encode(message))

    def _receive(self) -> Any:
        """The core's next message; raises ``EngineDeadError`` when the core is gone."""
        while not self._socket.poll(int(LIVENESS_INTERVAL_S * 1000)):
            if not core_process_alive(self.pid):
                self._live.clear()
                raise EngineDeadError(f"the engine-core process (pid {self.pid}) died")
        message = self._decoder.decode(self._socket.recv())
        if isinstance(message, EngineFailed):
            self._live.clear()
            raise EngineDeadError(message.message)
        if isinstance(message, RequestsDropped):  # the core aborted them already
            for request_id in message.request_ids:
                self._live.discard(request_id)
                self._assembler.forget(request_id)
            raise EngineDeadError(f"the engine core dropped requests {message.request_ids}: {message.reason}")
        return message

    def _answer(self, kind: type, key: Any) -> Any:
        """Wait for the answer ``kind`` with ``key``; outputs met on the way are kept for ``step``."""
        while True:
            message = self._receive()
            if isinstance(message, OutputBatch):
                self._early.append(message)
            elif isinstance(message, kind) and (message.request_id if kind is AddResult else message.call_id) == key:
                return message

    def call(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        result: UtilityResult = self._answer(UtilityResult, call_id)
        if result.error is not None:
            raise RuntimeError(f"engine call {method} failed: {result.error}")
        return result.value

    # ----------------------------------------------- LLMEngine's methods

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: Any,
                    params: SamplingParams | BeamSearchParams | PoolingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        params = params or self.get_default_sampling_params()
        self._add(add_message(self.info, request_id, prompt, params, priority, cache_salt, lora_request))

    def _add(self, message: AddRequest) -> None:
        self._send(message)
        result: AddResult = self._answer(AddResult, message.request_id)
        if result.error is not None:
            raise request_error(result.error)
        self._live.add(message.request_id)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        live = [rid for rid in ids if rid in self._live]
        for rid in live:
            self._live.discard(rid)
            self._assembler.forget(rid)
        if live:
            self._send(AbortRequests(live))

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step for this process's live requests; [] without any
        (the core sends nothing until it has work: waiting would never end)."""
        if not self._live:
            return []
        batch = self._early.popleft() if self._early else self._answer_batch()
        outputs = []
        for delta in batch.outputs:
            if delta.request_id not in self._live:
                self._assembler.forget(delta.request_id)
                continue
            output = self._assembler.assemble(delta)
            if output.finished:
                self._live.discard(delta.request_id)
            outputs.append(output)
        return outputs

    def _answer_batch(self) -> OutputBatch:
        while True:
            message = self._receive()
            if isinstance(message, OutputBatch):
                return message

    def get_tokenizer(self):
        return self.info.tokenizer

    def get_image_processor(self):
        return self.info.multimodal

    @property
    def pooler_spec(self) -> PoolerSpec | None:  # what the core's engine pools (None: it generates)
        return self.info.pooler_spec

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.info.default_sampling_params)

    def capacity_line(self) -> str:
        return self._capacity_line

    def stats(self) -> dict:
        return self.call("stats")

    def kv_pool_snapshot(self) -> dict:
        return self.call("kv_pool_snapshot")

    def reset_prefix_cache(self) -> int:
        return self.call("reset_prefix_cache")

    def reset_peak_blocks_in_use(self) -> None:
        self.call("reset_peak_blocks_in_use")

    def check_invariants(self) -> None:
        self.call("check_invariants")

    @property
    def step_timings(self) -> dict[str, float]:
        return self.call("step_timings")

    def reset_step_timings(self) -> None:
        self.call("reset_step_timings")

    def weight_bytes(self) -> int:
        return self.call("weight_bytes")

    def metrics_registry(self) -> _RemoteRegistry:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.core.launch.metrics_address)
        try:
            socket.send(b"")
            if not socket.poll(10_000):
                raise EngineDeadError("the engine core's metrics did not answer within 10 s")
            return _RemoteRegistry(socket.recv().decode())
        finally:
            socket.close()

    def shutdown(self) -> None:
        """Stop the core (it finishes the disk tier's writes) and close the socket. Safe to call twice."""
        self.core.shutdown()
        if not self._socket.closed:
            self._socket.close()
            self._context.term()

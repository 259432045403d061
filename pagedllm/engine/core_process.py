"""The engine core in a process of its own (vLLM v1's ``EngineCoreProc``).

The process owns an ``LLMEngine``: scheduler, runner, the output bookkeeping.
API processes reach it over one ZMQ ROUTER socket (``core_messages`` says what
crosses). Its loop: take every waiting message (adds, aborts, utility calls:
all between steps, so none interleaves with a step's bookkeeping), step when
there is work, send each client the deltas of its requests; idle, it sleeps on
the socket. Tokenizing, templates, JSON and SSE are the API processes' work,
so they no longer compete with the step for one interpreter.

Safety rules:
- A client that does not read (hung, or gone) never blocks the core: sends
  never wait (``ROUTER_MANDATORY`` with a bounded queue); a send that cannot
  be queued aborts that client's requests, freeing their blocks.
- A step that raises leaves the pool in doubt: the core aborts every request,
  tells every client (``EngineFailed``) and exits with status 1; whoever
  launched it decides whether to start another.
- The process exits when its parent does (checked every idle second), and on
  SIGTERM after finishing the engine's shutdown (the disk tier's writes).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from pagedllm.multimodal.wire import features_from_wire
from pagedllm.engine.core_messages import (AbortRequests, AddRequest, AddResult, EngineFacts, EngineFailed, Hello,
                                           OutputBatch, OutputDelta, Ready, RequestError, RequestsDropped, UtilityCall,
                                           UtilityResult, input_codec, output_codec)
from pagedllm.engine.lora_admin import add_lora, remove_lora, value_or_refusal
from pagedllm.engine.output_deltas import DeltaEncoder
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest

logger = init_logger(__name__)

# Messages queued for one client before the core gives up on it (about that many steps of outputs).
CLIENT_QUEUE_LIMIT = 4096
_IDLE_POLL_MS = 1000  # how often an idle core checks that its parent lives
# Requests come one message each (one HTTP request, or one add of LLM.generate's loop, which
# waits for its answer). A step taken after the first of a burst would run a small batch and
# the rest would join a step later: after adds, the core keeps taking messages until none
# comes for _BURST_GAP_MS, for at most _BURST_LIMIT_S, so the burst is scheduled together.
_BURST_GAP_MS = 1
_BURST_LIMIT_S = 0.02


@dataclass(frozen=True)
class CoreLaunch:
    """How to start an engine core: picklable, it is what the spawned process receives."""

    engine_options: dict[str, Any]  # ``EngineConfig.from_options``' keywords
    address: str  # the ZMQ endpoint the core binds
    served_model_name: str | None = None  # the metrics' model_name label (the server's first name)
    metrics_namespace: str | None = None
    log_stats_interval: float | None = None  # seconds between stat log lines; None: none

    @property
    def metrics_address(self) -> str:
        return metrics_address(self.address)

    @staticmethod
    def new_address() -> str:
        """A fresh IPC endpoint in a folder of its own that only this user may enter
        (``mkdtemp``'s 0700): another local user can neither send the core requests nor
        answer an API process in its place (the API side unpickles the core's tokenizer)."""
        return f"ipc://{tempfile.mkdtemp(prefix='pagedllm-core-')}/core.sock"

    def remove_address(self) -> None:
        """Remove the endpoint's folder (its sockets are gone once the core stopped)."""
        folder = os.path.dirname(self.address.removeprefix("ipc://"))
        if self.address.startswith("ipc://") and os.path.basename(folder).startswith("pagedllm-core-"):
            shutil.rmtree(folder, ignore_errors=True)


def metrics_address(address: str) -> str:
    """Where the core bound at ``address`` answers metrics requests, from a thread
    beside its loop: a step of seconds does not delay /metrics."""
    return f"{address}.metrics"


# What a ``UtilityCall`` may run on the engine: name -> the call (between steps).
UTILITY_METHODS: dict[str, Callable[..., Any]] = {
    "stats": lambda engine: engine.stats(),
    "kv_pool_snapshot": lambda engine: engine.kv_pool_snapshot(),
    "reset_prefix_cache": lambda engine: engine.reset_prefix_cache(),
    "reset_peak_blocks_in_use": lambda engine: engine.reset_peak_blocks_in_use(),
    "check_invariants": lambda engine: engine.check_invariants(),
    "step_timings": lambda engine: dict(engine.step_timings),
    "reset_step_timings": lambda engine: engine.reset_step_timings(),
    "weight_bytes": lambda engine: engine.weight_bytes(),
    "num_unfinished_requests": lambda engine: engine.get_num_unfinished_requests(),
    # A refused adapter comes back as (None, message) data, for the server's 400 (``lora_admin``).
    "add_lora": lambda engine, name, int_id, path: value_or_refusal(
        lambda: add_lora(engine, LoRARequest(name, int_id, path))),
    "remove_lora": lambda engine, name: value_or_refusal(lambda: remove_lora(engine, name)),
}


def engine_facts(engine) -> EngineFacts:
    """``EngineInfo.of(engine)`` as plain data, with the tokenizer pickled."""
    from pagedllm.engine.engine_info import EngineInfo

    info = EngineInfo.of(engine)
    return EngineFacts(
        pid=os.getpid(), tokenizer_pickle=pickle.dumps(info.tokenizer), max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids), max_num_seqs=info.max_num_seqs,
        max_logprobs=info.max_logprobs, scheduling_policy=info.scheduling_policy,
        default_sampling_params=dict(info.default_sampling_params), capacity_line=engine.capacity_line(),
        pooler_spec=info.pooler_spec,
        multimodal_pickle=None if info.multimodal is None else pickle.dumps(info.multimodal),
    )


class EngineCore:
    """The loop of the core process over one bound ROUTER socket (see the module's rules)."""

    def __init__(self, engine, socket: zmq.Socket) -> None:
        self.engine = engine
        self.socket = socket
        self._encoder, _ = output_codec()
        _, self._decoder = input_codec()
        self._facts = engine_facts(engine)
        self._deltas = DeltaEncoder()
        self._owner: dict[str, bytes] = {}  # live request id -> the client identity that added it
        self._dropped: dict[bytes, list[str]] = {}  # client -> requests aborted while its queue was full
        self.stopping = False

    def run(self, parent_pid: int | None) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished_requests()
            if self.socket.poll(0 if busy else _IDLE_POLL_MS) and self._take_messages():
                self._take_burst()
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("the engine core's parent process is gone: the core stops")
                return
            if self._dropped:
                self._tell_dropped()
            if self.engine.has_unfinished_requests():
                self._step()

    def _take_burst(self) -> None:
        limit = time.monotonic() + _BURST_LIMIT_S
        while time.monotonic() < limit and self.socket.poll(_BURST_GAP_MS):
            self._take_messages()

    def _take_messages(self) -> int:
        """Handle every message waiting; how many were requests added."""
        added = 0
        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return added
            message = self._decoder.decode(payload)
            if isinstance(message, AddRequest):
                self._add(identity, message)
                added += 1
            elif isinstance(message, AbortRequests):
                self._abort(message.request_ids)
            elif isinstance(message, UtilityCall):
                self._send(identity, self._utility(message))
            elif isinstance(message, Hello):
                self._send(identity, Ready(self._facts))

    def _add(self, identity: bytes, message: AddRequest) -> None:
        from pagedllm.structured_output import StructuredOutputError

        try:
            params = message.beam or message.pooling or message.params
            prompt = message.prompt if message.mm_features is None else \
                {**message.prompt, "mm_features": features_from_wire(message.mm_features)}
            self.engine.add_request(message.request_id, prompt, params,
                                    priority=message.priority, cache_salt=message.cache_salt,
                                    lora_request=message.lora_request)
        except StructuredOutputError as exc:
            self._send(identity, AddResult(message.request_id, RequestError(str(exc), exc.kind, exc.reason)))
            return
        except ValueError as exc:
            self._send(identity, AddResult(message.request_id, RequestError(str(exc))))
            return
        self._owner[message.request_id] = identity
        self._send(identity, AddResult(message.request_id))

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        for request_id in request_ids:
            self._owner.pop(request_id, None)
            self._deltas.forget(request_id)

    def _utility(self, call: UtilityCall) -> UtilityResult:
        method = UTILITY_METHODS.get(call.method)
        if method is None:
            return UtilityResult(call.call_id, error=f"unknown engine call {call.method!r}; "
                                                     f"the calls are: {', '.join(UTILITY_METHODS)}")
        try:
            return UtilityResult(call.call_id, method(self.engine, *call.args))
        except Exception as exc:  # the caller gets it as an error; the core carries on
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed: the engine core stops")
            self._fail(exc)
            raise
        by_client: dict[bytes, list[OutputDelta]] = {}
        for output in outputs:
            identity = self._owner.get(output.request_id)
            if identity is None:
                continue  # aborted while its step ran
            by_client.setdefault(identity, []).append(self._deltas.encode(output))
            if output.finished:
                del self._owner[output.request_id]
        for identity, deltas in by_client.items():
            self._send(identity, OutputBatch(deltas))

    def _fail(self, exc: Exception) -> None:
        """Abort every request (their blocks go back) and tell every client why."""
        self.engine.abort_request(list(self.engine.requests))
        message = EngineFailed(f"the engine step raised {exc!r}")
        for identity in set(self._owner.values()):
            self._send(identity, message)
        self._owner.clear()

    def _send(self, identity: bytes, message: Any) -> None:
        try:
            self.socket.send_multipart([identity, self._encoder.encode(message)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            # Its queue is full (the client stopped reading) or it is gone: stop its work.
            lost = [rid for rid, owner in self._owner.items() if owner == identity]
            logger.warning("API client %r cannot take messages (%s): aborting its %d requests",
                           identity, exc, len(lost))
            self._abort(lost)
            if isinstance(exc, zmq.Again) and lost:  # alive but full: it hears of it once it reads again
                self._dropped.setdefault(identity, []).extend(lost)

    def _tell_dropped(self) -> None:
        """Send each client the requests aborted while its queue was full, once it has room
        (a client that is gone by then is forgotten)."""
        for identity in list(self._dropped):
            message = RequestsDropped(self._dropped[identity], "the API server did not read the engine core's "
                                                               f"outputs in time (queue of {CLIENT_QUEUE_LIMIT} full)")
            try:
                self.socket.send_multipart([identity, self._encoder.encode(message)], zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                pass
            del self._dropped[identity]


def run_engine_core(launch: CoreLaunch, parent_pid: int | None = None) -> None:
    """The core process's main: build the engine, bind, serve until told to stop.

    Exits with status 1 when the engine cannot be built or a step fails."""
    from pagedllm.config.engine import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.metrics import LoggingStatLogger

    engine = LLMEngine(EngineConfig.from_options(**launch.engine_options))
    if launch.served_model_name is not None:
        engine.stats_reporter.configure(launch.served_model_name, launch.metrics_namespace or "pagedllm")
    if launch.log_stats_interval is not None:
        engine.stats_reporter.loggers.append(LoggingStatLogger(launch.log_stats_interval))
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.SNDHWM, CLIENT_QUEUE_LIMIT)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(launch.address)
    core = EngineCore(engine, socket)
    threading.Thread(target=_serve_metrics, args=(context, launch.metrics_address, engine.metrics_registry()),
                     name="pagedllm-core-metrics", daemon=True).start()

    def stop(signum, frame) -> None:
        core.stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        core.run(parent_pid)
    finally:
        socket.close()
        context.term()
        engine.shutdown()


def _serve_metrics(context: zmq.Context, address: str, registry) -> None:
    """Answer every request on ``address`` with the metrics text, beside the
    loop (prometheus_client makes reading the registry during a step safe)."""
    from prometheus_client import generate_latest

    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    try:
        while True:
            socket.recv()
            socket.send(generate_latest(registry))
    except zmq.ContextTerminated:
        socket.close()


def _core_main(launch: CoreLaunch, parent_pid: int) -> None:
    try:
        run_engine_core(launch, parent_pid)
    except Exception:
        logger.exception("the engine core failed")
        sys.exit(1)


class EngineCoreProcess:
    """A launched engine-core process, for whoever supervises it.

    Safety rule: call ``shutdown`` (or let the interpreter exit) to stop it; it
    also stops by itself when this process dies."""

    def __init__(self, launch: CoreLaunch) -> None:
        self.launch = launch
        self._process: multiprocessing.process.BaseProcess | None = None
        self.num_starts = 0

    def start(self) -> None:
        """Start (or, after it died, start again) the core; returns at once: it
        loads the model while clients wait for its ``Ready``."""
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(target=_core_main, args=(self.launch, os.getpid()),
                                        name="pagedllm-engine-core", daemon=False)
        self._process.start()
        self.num_starts += 1

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status once it stopped."""
        return self._process.exitcode if self._process is not None else None

    def exit_code(self) -> int | None:  # the supervisor's ``Child`` asks this way (replicas answer so too)
        return self.exitcode

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the endpoint's folder goes too. Safe to call twice."""
        process = self._process
        if process is not None and process.exitcode is None:
            process.terminate()
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
                process.join()
        self.launch.remove_address()


"""KV cache events on the wire, in vLLM's format, so a router built for vLLM
(llm-d, NVIDIA Dynamo) consumes pagedllm's.

Each batch is a msgpack array ``[ts, [event, ...], data_parallel_rank]``;
each event a tagged array: ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved",
block_hashes, medium]``, ``["AllBlocksCleared"]``. Hashes are
``external_block_hash`` ints (``pagedllm.core.block_hash``). A batch goes out
as the ZMQ multipart ``[topic, sequence number (8 bytes, big-endian), payload]``
on a PUB socket; a ROUTER socket on ``replay_endpoint`` answers a request for
the batches from a sequence number on (vLLM's replay protocol, docs/kv_events.md).

Safety rule: ``publish`` never blocks its caller (the engine's step): batches
go through a bounded queue to a thread that owns the sockets; a full queue
drops the batch and counts it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from pagedllm.core.block_hash import external_block_hash
from pagedllm.core import kv_events as core
from pagedllm.kv_events_config import KVEventsConfig
from pagedllm.logger import init_logger

logger = init_logger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the wire events (the tag is the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(events: list[core.KVEvent]) -> list[KVCacheEvent]:
    """The engine's event records as wire events (hashes as their external ints)."""
    wire: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, core.BlockStored):
            parent = None if event.parent_block_hash is None else external_block_hash(event.parent_block_hash)
            wire.append(BlockStored([external_block_hash(h) for h in event.block_hashes], parent,
                                    list(event.token_ids), event.block_size, None, event.medium))
        elif isinstance(event, core.BlockRemoved):
            wire.append(BlockRemoved([external_block_hash(h) for h in event.block_hashes], event.medium))
        else:
            wire.append(AllBlocksCleared())
    return wire


class NullEventPublisher:
    """Publishes nothing (``publisher: "null"``)."""

    def publish(self, events: list[core.KVEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """PUB socket + optional ROUTER replay socket, both owned by one daemon thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped_batches = 0
        self._queue: queue.Queue[list[core.KVEvent] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context.instance()
        self._pub = self._socket(zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = self._socket(zmq.ROUTER, config.replay_endpoint) if config.replay_endpoint else None
        self._next_seq = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="pagedllm-kv-events")
        self._thread.start()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        """Bind a wildcard or local endpoint (``tcp://*:5557``), connect to anything else, as vLLM."""
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0", "") or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
        return socket

    def publish(self, events: list[core.KVEvent]) -> None:
        if not events or self._closed:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped_batches += 1
            if self.num_dropped_batches == 1:
                logger.warning("KV events: the publisher queue is full (%d batches); batches are dropped",
                               self.config.max_queue_size)

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and dict(poller.poll(0)):
                self._answer_replay()
            try:
                events = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if events is None:
                return
            self._send(events)

    def _send(self, events: list[core.KVEvent]) -> None:
        batch = KVEventBatch(ts=time.time(), events=to_wire(events), data_parallel_rank=self.data_parallel_rank)
        payload = self._encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _answer_replay(self) -> None:
        """vLLM's replay: [client, b"", start seq] in; every buffered batch from it, then the end marker, out."""
        frames = self._replay.recv_multipart()
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def shutdown(self) -> None:
        """Send what is queued (bounded), stop the thread, close the sockets. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=2.0)
        except queue.Full:  # the thread is stuck behind a full queue: it is a daemon, let it go
            pass
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def make_event_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | NullEventPublisher:
    if config is None or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config)

"""The KV event publisher: a replica's KV cache events on a ZMQ PUB socket, in
vLLM's format (``pagedllm.kv_tiers.event_wire``), with vLLM's replay protocol.

A batch goes out as the ZMQ multipart ``[topic, sequence number (8 bytes, big-endian), payload]``
on a PUB socket; a ROUTER socket on ``replay_endpoint`` answers a request for
the batches from a sequence number on (vLLM's replay protocol, docs/kv_events.md).

Safety rules: ``publish`` never blocks its caller (the engine's step): batches
go through a bounded queue to one daemon thread, which alone touches the
sockets (ZMQ sockets are not thread-safe) and closes them when it stops; a full
queue drops the batch and counts it. ``shutdown`` waits at most about
``FLUSH_S`` for the queue to drain.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pagedllm.core import kv_events as core
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.kv_tiers.event_wire import END_OF_REPLAY, KVEventBatch, to_wire
from pagedllm.logger import init_logger

logger = init_logger(__name__)

FLUSH_S = 1.0  # how long shutdown lets the thread send what is still queued
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::", "")


class NullEventPublisher:
    """Publishes nothing (``publisher: "null"``, or events off)."""

    def publish(self, events: list[core.KVEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


def _open(context: zmq.Context, kind: int, endpoint: str, hwm: int, bind: bool | None = None) -> zmq.Socket:
    """A socket bound to a wildcard or ipc/inproc endpoint and connected to any
    other (vLLM's rule: the stable side binds), unless ``bind`` says which."""
    socket = context.socket(kind)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, hwm)  # before bind/connect: ZMQ applies it to later pipes only
        host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
        if host.startswith("[") or host == "::":
            socket.setsockopt(zmq.IPV6, 1)
        if bind is None:
            bind = host in _WILDCARD_HOSTS or endpoint.startswith(("ipc://", "inproc://"))
        if bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as error:
        socket.close(linger=0)
        raise ValueError(f"kv_events_config: cannot open {endpoint!r} ({error}); choose a free endpoint") from error
    return socket


class ZmqEventPublisher:
    """A PUB socket for the live stream and an optional ROUTER replay socket,
    both owned by one daemon thread that drains a bounded queue."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped_batches = 0  # written by the caller's thread only (publish, then shutdown)
        self._queue: queue.Queue[list[core.KVEvent]] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._next_seq = 0
        self._closed = False
        self._stop = threading.Event()
        self._deadline = 0.0
        context = zmq.Context.instance()
        self._pub = _open(context, zmq.PUB, config.endpoint, config.hwm)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint is not None:
            try:  # always bound, as vLLM's; its HWM lets one whole replay through
                self._replay = _open(context, zmq.ROUTER, config.replay_endpoint, config.buffer_steps + 1, bind=True)
            except ValueError:
                self._pub.close(linger=0)
                raise
        self._thread = threading.Thread(target=self._run, daemon=True, name="pagedllm-kv-events")
        self._thread.start()

    def publish(self, events: list[core.KVEvent]) -> None:
        """Queue one step's events; never waits (a full queue drops the batch)."""
        if not events or self._closed:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped_batches += 1
            if self.num_dropped_batches == 1:
                logger.warning("KV events: the publisher queue is full (max_queue_size=%d batches); batches "
                               "are dropped (counted in num_dropped_batches)", self.config.max_queue_size)

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        # With a replay socket, wake often to answer it; without, only to see a stop.
        wait_s = 0.01 if self._replay is not None else 0.1
        try:
            while not (self._stop.is_set() and time.monotonic() >= self._deadline):
                if self._replay is not None and poller.poll(0):
                    self._answer_replay()
                try:
                    events = self._queue.get(timeout=wait_s)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                    continue
                self._send(events)
        except Exception:  # a failed thread must not take the engine with it; say why events stopped
            logger.exception("KV events: the publisher thread failed; no more events are sent")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, events: list[core.KVEvent]) -> None:
        batch = KVEventBatch(ts=time.time(), events=to_wire(events), data_parallel_rank=self.data_parallel_rank)
        payload = self._encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _answer_replay(self) -> None:
        """vLLM's replay: ``[client, b"", start seq]`` in; every buffered batch
        from ``start`` on, then the end marker, out. A malformed request is ignored."""
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            logger.warning("KV events: ignored a replay request that is not an 8-byte sequence number: %r",
                           frames[1:])
            return
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def shutdown(self) -> None:
        """Send what is queued (for at most about ``FLUSH_S``), stop the thread,
        which closes the sockets with linger 0. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + FLUSH_S
        self._stop.set()
        self._thread.join(timeout=FLUSH_S + 1.0)
        if self._thread.is_alive():  # still in one batch; a daemon, it stops after it and closes the sockets
            logger.warning("KV events: the publisher thread did not stop within %.1f s", FLUSH_S + 1.0)
        # What the thread left queued (past the deadline, or after it failed) is never sent.
        unsent = self._queue.qsize()
        if unsent:
            self.num_dropped_batches += unsent
            logger.warning("KV events: %d queued batches were not sent before shutdown", unsent)


def make_event_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` asks for; None (events off) or ``"null"`` publish nothing."""
    if config is None or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config)

"""The KV event publisher against real ZMQ sockets on 127.0.0.1, as a router sees it.

Every wait is bounded (``WAIT_MS``) so a lost message fails a test instead of
hanging it. ZMQ's slow joiner (a SUB misses what is published before its
subscription reaches the PUB) is handled by publishing warm-up batches until
the subscriber receives one; the batches under test are numbered after them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import pytest
import zmq

from pagedllm.core import kv_events as core
from pagedllm.core.block_hash import extend_block_hashes, external_block_hash, hash_request_tokens
from pagedllm.core.block_pool import BlockPool
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.kv_tiers.event_wire import (END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored,
                                          KVEventBatch, to_wire)
from pagedllm.kv_tiers.events import NullEventPublisher, ZmqEventPublisher, make_event_publisher

WAIT_MS = 5000
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
DIGESTS = [bytes([i]) * 32 for i in range(1, 9)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def zmq_socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def recv(sock: zmq.Socket, timeout_ms: int = WAIT_MS) -> list[bytes]:
    if not sock.poll(timeout_ms):
        raise AssertionError(f"nothing arrived within {timeout_ms} ms")
    return sock.recv_multipart()


def subscriber(port: int, topic: str = "", bind: bool = False) -> zmq.Socket:
    sub = zmq_socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    address = f"tcp://127.0.0.1:{port}"
    sub.bind(address) if bind else sub.connect(address)
    return sub


def warm_up(publisher: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """Publish until ``sub`` receives a batch; returns the next batch's sequence number."""
    deadline = time.monotonic() + WAIT_MS / 1000
    published = 0
    while time.monotonic() < deadline:
        publisher.publish([core.AllBlocksCleared()])
        published += 1
        if sub.poll(50):
            break
    else:
        raise AssertionError("the subscriber never joined")
    return published


def receive_from(sub: zmq.Socket, first_seq: int, count: int) -> list[tuple[bytes, int, KVEventBatch]]:
    """The ``count`` batches numbered from ``first_seq`` (earlier warm-up batches are skipped)."""
    got = []
    while len(got) < count:
        topic, seq, payload = recv(sub)
        if int.from_bytes(seq, "big") >= first_seq:
            got.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


def replay(port: int, start: int) -> tuple[dict[int, KVEventBatch], list[bytes]]:
    """vLLM's replay as a DEALER client: the batches from ``start`` and the end marker's frames."""
    dealer = zmq_socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        batches = {}
        while True:
            frames = recv(dealer)
            if frames[1] == END_OF_REPLAY:
                return batches, frames
            empty, seq, payload = frames
            assert empty == b""
            batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    finally:
        dealer.close()


def make_publisher(**options) -> tuple[ZmqEventPublisher, int]:
    port = free_port()
    config = KVEventsConfig.from_option({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", **options})
    return ZmqEventPublisher(config, data_parallel_rank=2), port


def steps(n: int) -> list[list[core.KVEvent]]:
    """``n`` steps' events of every kind and medium."""
    out = []
    for i in range(n):
        a, b = DIGESTS[i % 8], DIGESTS[(i + 1) % 8]
        out.append([core.BlockStored([a, b], None if i % 2 else DIGESTS[0], list(range(i, i + 32)), 16,
                                     (core.MEDIUM_POOL, core.MEDIUM_HOST, core.MEDIUM_DISK)[i % 3]),
                    core.BlockRemoved([b], core.MEDIUM_POOL)] + ([core.AllBlocksCleared()] if i % 4 == 3 else []))
    return out


@pytest.fixture
def gate():
    """Holds the publisher thread inside its next send until released (a stalled network)."""
    entered, release = threading.Event(), threading.Event()

    def hold(publisher: ZmqEventPublisher) -> None:
        send = publisher._send

        def held_send(events):
            entered.set()
            release.wait(10)
            send(events)

        publisher._send = held_send

    hold.entered, hold.release = entered, release
    yield hold
    release.set()


def test_batches_arrive_in_order_numbered_from_0_with_the_published_fields():
    publisher, port = make_publisher(topic="kv")
    sub = subscriber(port, "kv")
    try:
        first = warm_up(publisher, sub)
        published = steps(12)
        before = time.time()
        for events in published:
            publisher.publish(events)
        got = receive_from(sub, first, len(published))
        assert [seq for _, seq, _ in got] == list(range(first, first + len(published)))
        for (topic, _, batch), events in zip(got, published):
            assert topic == b"kv" and batch.data_parallel_rank == 2
            assert before - 1 <= batch.ts <= time.time() + 1
            assert batch.events == to_wire(events)
        stored = got[0][2].events[0]
        assert stored == BlockStored([external_block_hash(DIGESTS[0]), external_block_hash(DIGESTS[1])],
                                     external_block_hash(DIGESTS[0]), list(range(32)), 16, None, "GPU")
        assert got[0][2].events[1] == BlockRemoved([external_block_hash(DIGESTS[1])], "GPU")
        assert got[3][2].events[-1] == AllBlocksCleared()
        assert {b.events[0].medium for _, _, b in got} == {"GPU", "CPU", "DISK"}
        assert publisher.num_dropped_batches == 0
    finally:
        sub.close()
        publisher.shutdown()


def test_the_payload_is_vllms_msgpack_array_layout():
    batch = KVEventBatch(ts=1.5, events=to_wire(steps(4)[3]), data_parallel_rank=0)
    ts, events, rank = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    h0, h1, h4 = (external_block_hash(DIGESTS[i]) for i in (0, 3, 4))
    assert (ts, rank) == (1.5, 0)
    assert events == [["BlockStored", [h1, h4], None, list(range(3, 35)), 16, None, "GPU", None, None],
                      ["BlockRemoved", [h4], "GPU"], ["AllBlocksCleared"]]
    assert h0 == int.from_bytes(DIGESTS[0][-8:], "big")
    # Array-like structs carry every field, defaults included, as vLLM's do.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(2.0, [AllBlocksCleared()]))) == [
        2.0, [["AllBlocksCleared"]], None]
    with pytest.raises(ValueError, match="not a KV event"):
        to_wire(["BlockStored"])


def test_a_topic_reaches_only_its_subscribers():
    publisher, port = make_publisher(topic="kv")
    other = subscriber(port, "other")
    sub = subscriber(port, "kv")
    try:
        first = warm_up(publisher, sub)
        publisher.publish(steps(1)[0])
        assert receive_from(sub, first, 1)[0][0] == b"kv"
        assert not other.poll(300)
    finally:
        other.close()
        sub.close()
        publisher.shutdown()


def test_replay_from_the_middle_returns_the_buffered_batches_then_the_end_marker():
    replay_port = free_port()
    publisher, port = make_publisher(replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=8)
    sub = subscriber(port)
    try:
        first = warm_up(publisher, sub)
        published = steps(6)
        for events in published:
            publisher.publish(events)
        live = receive_from(sub, first, 6)  # all sent, so all buffered
        batches, end = replay(replay_port, first + 2)
        assert sorted(batches) == list(range(first + 2, first + 6))
        assert [batches[seq] for seq in sorted(batches)] == [b for _, _, b in live[2:]]
        assert end == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert replay(replay_port, first + 6)[0] == {}  # nothing newer: the end marker alone
        # The buffer keeps the last buffer_steps batches; numbering started at 0.
        everything, _ = replay(replay_port, 0)
        assert sorted(everything) == list(range(max(0, first + 6 - 8), first + 6))
        # A malformed request is ignored and the socket keeps answering.
        dealer = zmq_socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", b"\x01"))
        assert not dealer.poll(200)
        dealer.close()
        assert sorted(replay(replay_port, first + 5)[0]) == [first + 5]
    finally:
        sub.close()
        publisher.shutdown()


def test_numbering_starts_at_0_as_replay_shows():
    replay_port = free_port()
    publisher, _ = make_publisher(replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    try:
        for events in steps(3):
            publisher.publish(events)
        deadline = time.monotonic() + WAIT_MS / 1000
        batches: dict = {}
        while len(batches) < 3 and time.monotonic() < deadline:  # the thread may still be sending
            batches, _ = replay(replay_port, 0)
        assert sorted(batches) == [0, 1, 2]
        assert [b.events for b in batches.values()] == [to_wire(e) for e in steps(3)]
    finally:
        publisher.shutdown()


def test_a_full_queue_drops_batches_without_blocking_and_warns_once(gate):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("pagedllm.kv_tiers.events")
    logger.addHandler(handler)
    publisher, port = make_publisher(max_queue_size=2)
    try:
        gate(publisher)
        publisher.publish(steps(1)[0])
        assert gate.entered.wait(WAIT_MS / 1000)  # the thread is stuck sending batch 0
        started = time.monotonic()
        for events in steps(50):
            publisher.publish(events)  # 2 fit the queue, 48 are dropped
        assert time.monotonic() - started < 0.5
        assert publisher.num_dropped_batches == 48
        warnings = [r for r in records if r.levelno == logging.WARNING and "full" in r.getMessage()]
        assert len(warnings) == 1 and "max_queue_size=2" in warnings[0].getMessage()
    finally:
        logger.removeHandler(handler)
        gate.release.set()
        publisher.shutdown()


def test_shutdown_sends_what_is_queued_and_twice_is_fine(gate):
    publisher, port = make_publisher()
    sub = subscriber(port)
    try:
        first = warm_up(publisher, sub)
        gate(publisher)
        publisher.publish(steps(1)[0])
        assert gate.entered.wait(WAIT_MS / 1000)
        for events in steps(5):
            publisher.publish(events)
        gate.release.set()
        publisher.shutdown()
        assert [seq for _, seq, _ in receive_from(sub, first, 6)] == list(range(first, first + 6))
        publisher.shutdown()
        publisher.publish(steps(1)[0])  # after shutdown: nothing, and no error
        assert not sub.poll(200)
        assert publisher.num_dropped_batches == 0
    finally:
        sub.close()
        publisher.shutdown()


def test_shutdown_is_bounded_when_the_network_stalls(gate):
    publisher, _ = make_publisher()
    gate(publisher)
    publisher.publish(steps(1)[0])
    assert gate.entered.wait(WAIT_MS / 1000)
    for events in steps(3):
        publisher.publish(events)  # queued behind the stuck batch
    started = time.monotonic()
    publisher.shutdown()
    assert time.monotonic() - started < 3.0
    assert publisher.num_dropped_batches == 3  # never sent: counted as dropped
    gate.release.set()


def test_a_non_wildcard_endpoint_connects_to_a_collector_that_binds():
    port = free_port()
    collector = subscriber(port, bind=True)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    publisher = ZmqEventPublisher(config)
    try:
        first = warm_up(publisher, collector)
        publisher.publish(steps(1)[0])
        (_, seq, batch), = receive_from(collector, first, 1)
        assert seq == first and batch.data_parallel_rank == 0
    finally:
        collector.close()
        publisher.shutdown()


def test_a_busy_endpoint_is_refused_by_name():
    publisher, port = make_publisher()
    try:
        with pytest.raises(ValueError, match="kv_events_config"):
            make_publisher(endpoint=f"tcp://*:{port}")
        with pytest.raises(ValueError, match="kv_events_config"):
            make_publisher(replay_endpoint=f"tcp://127.0.0.1:{port}")
    finally:
        publisher.shutdown()


def test_what_the_pool_stores_is_what_a_router_computes():
    """The pool's BlockStored, on the wire, carries ``hash_request_tokens`` of the prompt."""
    log = core.KVEventLog()
    pool = BlockPool(8, events=log)
    tokens = list(range(1000, 1000 + 16 * 3 + 7))
    hashes = extend_block_hashes([], tokens, 16, ("tenant",))
    for index, block in enumerate(pool.get_new_blocks(3)):
        pool.cache_block(block, hashes[index], hashes[index - 1] if index else None,
                         tokens[index * 16:(index + 1) * 16])
    wire = to_wire(log.take())
    assert [h for e in wire for h in e.block_hashes] == hash_request_tokens(tokens, 16, cache_salt="tenant")
    assert [e.parent_block_hash for e in wire] == [None] + hash_request_tokens(tokens, 16, "tenant")[:2]
    assert all(e.medium == "GPU" and e.block_size == 16 and e.lora_id is None for e in wire)


def test_null_publishers_and_the_factory():
    assert isinstance(make_event_publisher(None), NullEventPublisher)
    assert KVEventsConfig().publisher == "null" and isinstance(make_event_publisher(KVEventsConfig()),
                                                                NullEventPublisher)
    null = make_event_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    assert isinstance(null, NullEventPublisher)
    null.publish(steps(1)[0])
    null.shutdown()
    null.shutdown()
    port = free_port()
    zmq_publisher = make_event_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    try:
        assert isinstance(zmq_publisher, ZmqEventPublisher) and zmq_publisher.config.publisher == "zmq"
    finally:
        zmq_publisher.shutdown()


@pytest.mark.parametrize("option, message", [
    ({"enable_kv_cache_events": True, "topics": "kv"}, "unknown keys.*'topics'.*the keys are: enable_kv_cache_events"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be one of null, zmq"),
    ({"enable_kv_cache_events": True, "endpoint": 5557}, "endpoint must be a string"),
    ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint must be a ZMQ address"),
    ({"enable_kv_cache_events": True, "replay_endpoint": 5558}, "replay_endpoint must be a string"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5557"}, "replay_endpoint must differ"),
    ({"enable_kv_cache_events": True, "topic": None}, "topic must be a string"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps must be an integer >= 1"),
    ({"enable_kv_cache_events": True, "max_queue_size": 2.5}, "max_queue_size"),
    ({"enable_kv_cache_events": True, "hwm": -1}, "hwm must be an integer >= 0"),
    ({"enable_kv_cache_events": True, "hwm": True}, "hwm"),
    (["enable_kv_cache_events"], "JSON object"),
])
def test_bad_configs_are_refused_naming_the_key(option, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_option(option)


def test_config_defaults_are_vllms_and_off_means_none():
    assert KVEventsConfig.from_option(None) is None
    assert KVEventsConfig.from_option({}) is None
    assert KVEventsConfig.from_option({"enable_kv_cache_events": False, "publisher": "zmq"}) is None
    config = KVEventsConfig.from_option({"enable_kv_cache_events": True})
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.buffer_steps, config.hwm,
            config.max_queue_size, config.topic) == ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert KVEventsConfig.from_option(config) is config
    assert KVEventsConfig.from_option({"enable_kv_cache_events": True, "hwm": 0}).hwm == 0

"""KV events in vLLM's wire format: a real ZMQ subscriber rebuilds what the
engine caches, and a router recomputes block hashes from token ids alone."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time

import msgspec
import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import extend_block_hashes, external_block_hash, hash_request_tokens
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.kv_tiers.event_wire import END_OF_REPLAY, KVEventBatch
from pagedllm.kv_tiers.events import ZmqEventPublisher
from pagedllm.core import kv_events as core
from tests.conftest import assert_pool_free


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Subscriber:
    """What a router does: SUB for the live stream, DEALER to replay what it missed."""

    def __init__(self, port: int, replay_port: int, topic: str = "") -> None:
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_address = f"tcp://127.0.0.1:{replay_port}"
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}
        self.topics: set[bytes] = set()

    def drain(self, quiet_s: float = 0.5, limit_s: float = 20.0) -> None:
        """Receive until nothing arrives for ``quiet_s`` (bounded by ``limit_s``)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)

    def replay_from(self, start: int) -> dict[int, KVEventBatch]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_address)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replayed = {}
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            replayed[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
        else:
            raise AssertionError("the replay socket did not answer")
        dealer.close()
        return replayed

    def complete(self) -> list[KVEventBatch]:
        """Every batch from sequence 0, filling gaps (the slow-joiner's first ones) from the replay socket."""
        last = max(self.batches, default=-1)
        missing = [seq for seq in range(last + 1) if seq not in self.batches]
        if missing or not self.batches:
            self.batches.update(self.replay_from(missing[0] if missing else 0))
        assert sorted(self.batches) == list(range(len(self.batches)))
        return [self.batches[seq] for seq in sorted(self.batches)]

    def close(self) -> None:
        self.sub.close(linger=0)


def cached_by_medium(batches: list[KVEventBatch]) -> dict[str, set[int]]:
    """The block sets a router keeps per medium, rebuilt from the events alone."""
    held: dict[str, set[int]] = {}
    for batch in batches:
        for event in batch.events:
            name = type(event).__name__
            if name == "BlockStored":
                held.setdefault(event.medium, set()).update(event.block_hashes)
            elif name == "BlockRemoved":
                held.setdefault(event.medium, set()).difference_update(event.block_hashes)
            else:
                held.clear()
    return held


def test_a_subscriber_rebuilds_the_pool_and_host_tier_from_events(tiny_llama):
    port, replay_port = _free_port(), _free_port()
    subscriber = Subscriber(port, replay_port, topic="kv")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    llm = LLM(tiny_llama, num_kv_blocks=12, max_num_seqs=2, kv_offload_host_bytes=1 << 20,
              kv_events_config=events, debug_invariants=True)
    try:
        prompts = [{"prompt_token_ids": [(c * 131 + j * 7) % 4000 + 100 for j in range(40 + 8 * r)]}
                   for r in range(3) for c in range(4)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        engine = llm.llm_engine
        engine.kv_channels.publish()  # what the last step recorded
        subscriber.drain()
        held = cached_by_medium(subscriber.complete())
        pool = {b["block_hash"] for b in llm.kv_pool_snapshot()["blocks"] if b["hashed"]}
        assert pool and held["GPU"] == pool
        host = {external_block_hash(h) for h in engine.kv_tiers.index.host_hashes}
        assert host and held["CPU"] == host
        # A stored event carries the block's tokens, parent and size as vLLM's does.
        stored = [e for b in subscriber.complete() for e in b.events if type(e).__name__ == "BlockStored"]
        first = next(e for e in stored if e.parent_block_hash is None)
        assert first.block_size == 16 and len(first.token_ids) == 16 and first.lora_id is None
        assert first.block_hashes == hash_request_tokens(first.token_ids)
        assert_pool_free(llm)  # resets the prefix cache: every pool and host block is removed
        engine.kv_channels.publish()
        subscriber.drain()
        batches = subscriber.complete()
        # Joined by now (a subscriber connecting before the engine binds may get its first batches by replay).
        assert subscriber.topics == {b"kv"}
        assert not cached_by_medium(batches)
        assert type(batches[-1].events[-1]).__name__ == "AllBlocksCleared"  # nothing is left in any medium
    finally:
        subscriber.close()
        llm.shutdown()


def test_the_publisher_numbers_batches_and_replays_from_any_point():
    port, replay_port = _free_port(), _free_port()
    config = KVEventsConfig.from_option({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                         "replay_endpoint": f"tcp://*:{replay_port}"})
    publisher = ZmqEventPublisher(config, data_parallel_rank=3)
    subscriber = Subscriber(port, replay_port)
    try:
        digest = bytes(range(32))
        for i in range(5):
            publisher.publish([core.BlockRemoved([digest], "GPU"), core.AllBlocksCleared()] if i == 4 else
                              [core.BlockStored([digest], None, list(range(16)), 16, "CPU")])
        publisher.publish([])  # nothing to say: no batch
        replayed = subscriber.replay_from(2)
        deadline = time.monotonic() + 10
        while len(replayed) < 3 and time.monotonic() < deadline:  # the thread may still be sending
            replayed = subscriber.replay_from(2)
        assert sorted(replayed) == [2, 3, 4]
        last = replayed[4]
        assert last.data_parallel_rank == 3
        assert [type(e).__name__ for e in last.events] == ["BlockRemoved", "AllBlocksCleared"]
        assert last.events[0].block_hashes == [external_block_hash(digest)]
        assert replayed[2].events[0].medium == "CPU" and replayed[2].events[0].token_ids == list(range(16))
        # The raw encoding is vLLM's: a batch is an array, an event an array tagged with its class name.
        raw = msgspec.msgpack.decode(msgspec.msgpack.encode(last))
        assert raw[1][1] == ["AllBlocksCleared"] and raw[1][0][0] == "BlockRemoved" and raw[2] == 3
    finally:
        subscriber.close()
        publisher.shutdown()
        publisher.shutdown()  # twice is fine


def _router_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """The documented algorithm, written from scratch as a router in another language would."""
    parent = hashlib.sha256(b"pagedllm-block-hash-v1").digest()
    extra = json.dumps([] if salt is None else [salt], separators=(",", ":")).encode()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.sha256(parent + len(block).to_bytes(8, "little")
                                + b"".join(t.to_bytes(8, "little", signed=True) for t in block) + extra).digest()
        out.append(int.from_bytes(digest[-8:], "big"))
        parent = digest
    return out


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_hash_request_tokens_is_the_documented_algorithm_and_the_engines(salt):
    tokens = [(i * 7919) % 49152 for i in range(16 * 5 + 9)]  # a partial last block has no hash
    hashes = hash_request_tokens(tokens, block_size=16, cache_salt=salt)
    assert len(hashes) == 5
    assert hashes == _router_hashes(tokens, 16, salt)
    engine = extend_block_hashes([], tokens, 16, (salt,) if salt is not None else ())
    assert hashes == [external_block_hash(h) for h in engine]
    assert all(0 <= h < 2**64 for h in hashes)
    assert hash_request_tokens(tokens, block_size=32, cache_salt=salt) == _router_hashes(tokens, 32, salt)


def test_salts_change_every_hash_and_bad_sizes_are_refused():
    tokens = list(range(64))
    plain, salted = hash_request_tokens(tokens), hash_request_tokens(tokens, cache_salt="x")
    assert not set(plain) & set(salted)
    with pytest.raises(ValueError):
        hash_request_tokens(tokens, block_size=12)


@pytest.mark.parametrize("option, message", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpont": "tcp://*:1"}, "unknown keys"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps"),
])
def test_bad_event_configs_are_refused_by_name(option, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_option(option)
    assert KVEventsConfig.from_option({"enable_kv_cache_events": False}) is None

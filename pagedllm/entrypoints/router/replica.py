"""One replica as the router sees it: up or down, its load, and its KV events.

A ``ReplicaWatch`` runs on the router's event loop: it polls the replica's
``/health`` (a replica that fails ``DOWN_AFTER_FAILURES`` polls in a row, or
does not answer within the timeout, is down: a hung one as well as a dead one),
reads its ``/server_info`` when it comes up (block size, KV-event sockets, and
a prompt fingerprint that must equal the router's), subscribes to its KV events
and feeds them to the shared ``PrefixIndex``, and reads its KV usage (every few polls) from
``/metrics``. When the replica goes down everything it was known to hold is
forgotten and ``down`` is set, which fails the requests in flight to it at once;
when it answers again (restarted) it rejoins with an empty record, filled from
its events (and their replay buffer, for what it cached before the router saw it).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from pagedllm.entrypoints.draining import says_draining
from pagedllm.entrypoints.openai.common import routes
from pagedllm.fleet.prefix_index import PrefixIndex
from pagedllm.kv_tiers.event_wire import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagedllm.logger import init_logger

logger = init_logger(__name__)

DOWN_AFTER_FAILURES = 2
# KV usage is read from /metrics every this many health polls: a replica renders its whole
# exposition for it, which costs its cores more than a /health answer.
USAGE_EVERY_POLLS = 4
_KV_USAGE = re.compile(r"^\w+:kv_cache_usage_perc(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")


class ReplicaMismatch(ValueError):
    """A replica renders or hashes prompts differently from the router."""


@dataclass
class Replica:
    """Shared between the watch (which writes ``up``, ``kv_usage``, ``block_size``)
    and the router (which counts ``in_flight``); both on one event loop."""

    index: int
    url: str
    up: bool = False
    ever_up: bool = False  # read by serve's supervisor thread: restart only a replica that once served
    in_flight: int = 0
    kv_usage: float = 0.0
    block_size: int = 16
    # From /server_info: the base model's served names (a request's model outside them names a LoRA
    # adapter) and each adapter's fingerprint, which the replica keys its blocks by beside the name.
    model_names: tuple[str, ...] = ()
    lora_fingerprints: dict[str, str] = field(default_factory=dict)
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while the replica is down
    last_error: str = "not contacted yet"

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.down.set()


def events_address(endpoint: str, replica_url: str) -> str:
    """A replica's KV-events endpoint as the router connects to it: a wildcard
    host (the replica bound every interface) becomes the replica's own host."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in _WILDCARD_HOSTS:
        return f"tcp://{urlsplit(replica_url).hostname}:{port}"
    return endpoint


def take_hashing_names(replica: Replica, info: dict) -> None:
    """What of a replica's /server_info the router hashes LoRA requests with: the base's
    served names and the adapters' fingerprints (an older replica names one model, no adapters)."""
    replica.model_names = tuple(info.get("model_names") or [info["model"]])
    replica.lora_fingerprints = dict(info.get("lora_adapters") or {})


async def refresh_adapters(replica: Replica, client: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
    """Re-read the replica's adapters (loaded or unloaded since it joined)."""
    take_hashing_names(replica, (await client.get(f"{replica.url}{routes.SERVER_INFO}", timeout=timeout_s)).json())


class ReplicaWatch:
    """Keeps one ``Replica`` current; ``run`` until cancelled."""

    def __init__(self, replica: Replica, index: PrefixIndex, client: httpx.AsyncClient, fingerprint: str,
                 context: zmq.asyncio.Context, interval_s: float = 0.5, timeout_s: float = 2.0) -> None:
        self.replica, self.index, self.client = replica, index, client
        self.fingerprint, self.context = fingerprint, context
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._events_task: asyncio.Task | None = None
        # Event followers cancelled but maybe not yet ended: ``run`` awaits them, so their
        # sockets are closed before the router terminates the zmq context (``term`` waits for that).
        self._ending_events: set[asyncio.Task] = set()
        self._failures = 0
        self._polls = 0

    async def run(self) -> None:
        try:
            while True:
                await self._poll()
                await asyncio.sleep(self.interval_s)
        finally:
            self._mark_down("the router stops")
            await asyncio.gather(*self._ending_events, return_exceptions=True)

    async def _poll(self) -> None:
        replica = self.replica
        draining = False
        try:
            health = await self.client.get(f"{replica.url}{routes.HEALTH}", timeout=self.timeout_s)
            healthy = health.status_code == 200
            draining = says_draining(health.status_code, health.content)
            reason = "it is shutting down (draining)" if draining else f"/health answered {health.status_code}"
        except httpx.HTTPError as exc:
            healthy, reason = False, f"/health failed: {type(exc).__name__}"
        if not healthy:
            self._failures += 1
            if replica.up and (draining or self._failures >= DOWN_AFTER_FAILURES):
                # A draining replica gets no new requests, but those it runs finish there.
                self._mark_down(reason, fail_requests=not draining)
            replica.last_error = reason
            return
        self._failures = 0
        self._polls += 1
        try:
            joining = not replica.up
            if joining:
                await self._join()
            if joining or self._polls % USAGE_EVERY_POLLS == 0:  # a rejoined replica's old usage is stale
                await self._read_usage()
            if not joining and self._polls % USAGE_EVERY_POLLS == 0:  # adapters loaded on it directly
                await refresh_adapters(replica, self.client, self.timeout_s)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ReplicaMismatch) and replica.last_error != error:  # once, not every poll
                logger.error("replica %s is not taken into the fleet: %s", replica.url, exc)
            replica.last_error = error

    async def _join(self) -> None:
        info = (await self.client.get(f"{self.replica.url}{routes.SERVER_INFO}", timeout=self.timeout_s)).json()
        if info.get("prompt_fingerprint") != self.fingerprint:
            raise ReplicaMismatch(
                "it renders prompts differently from this router (another model or chat template): start the "
                "router with the replicas' --model and --chat-template, or prefix routing can never hit")
        self.replica.block_size = int(info["block_size"])
        take_hashing_names(self.replica, info)
        kv_events = info.get("kv_events") or {}
        if kv_events.get("enable_kv_cache_events"):
            self._events_task = asyncio.create_task(self._follow_events(kv_events))
        else:
            logger.warning("replica %s publishes no KV events (--kv-events-config): the router cannot see its "
                           "cache and routes to it by what it sent there alone", self.replica.url)
        self.index.cleared(self.replica.index)
        self.replica.up = self.replica.ever_up = True
        self.replica.down = asyncio.Event()
        logger.info("replica %s is up", self.replica.url)

    def _mark_down(self, reason: str, fail_requests: bool = True) -> None:
        """No new requests go to the replica; with ``fail_requests`` those it runs end (503)."""
        replica = self.replica
        if replica.up:
            logger.warning("replica %s is down: %s", replica.url, reason)
        replica.up = False
        if fail_requests:
            replica.down.set()
        self.index.cleared(replica.index)
        if self._events_task is not None:
            self._events_task.cancel()
            self._ending_events.add(self._events_task)
            self._events_task.add_done_callback(self._ending_events.discard)
            self._events_task = None

    async def _read_usage(self) -> None:
        text = (await self.client.get(f"{self.replica.url}{routes.METRICS}", timeout=self.timeout_s)).text
        match = _KV_USAGE.search(text)
        if match:
            self.replica.kv_usage = float(match.group(1))

    async def _follow_events(self, settings: dict) -> None:
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        subscriber = self.context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        topic = settings.get("topic", "")
        subscriber.setsockopt_string(zmq.SUBSCRIBE, topic)
        subscriber.connect(events_address(settings.get("endpoint", "tcp://*:5557"), self.replica.url))
        try:
            if settings.get("replay_endpoint"):
                await self._replay(events_address(settings["replay_endpoint"], self.replica.url), decode)
            while True:
                _, _, payload = await subscriber.recv_multipart()
                self._apply(decode(payload))
        finally:
            subscriber.close()

    async def _replay(self, address: str, decode) -> None:
        """What the replica cached before the router subscribed: its buffered batches."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while await dealer.poll(int(self.timeout_s * 1000)):
                _, seq, payload = await dealer.recv_multipart()
                if seq == END_OF_REPLAY:
                    return
                self._apply(decode(payload))
        finally:
            dealer.close()

    def _apply(self, batch: KVEventBatch) -> None:
        replica = self.replica.index
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.index.cleared(replica)
            elif isinstance(event, BlockStored):
                self.index.stored(replica, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self.index.removed(replica, event.block_hashes, event.medium)


async def stop_watches(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def now() -> float:
    return time.monotonic()

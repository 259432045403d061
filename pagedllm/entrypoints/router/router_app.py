"""The router: one OpenAI endpoint in front of many replicas (``pagedllm router``).

Every path passes through unchanged (method, headers, body, status, streaming):
generation requests go to the replica the policy picks from the prompt's block
hashes, anything else to the least-loaded replica. ``/health``, ``/v1/models``,
``/metrics``, ``/reset_prefix_cache`` and the LoRA load / unload endpoints are the
router's own: up when one replica is, the replicas' models merged, its counters
beside every replica's metrics labelled ``replica``, every replica's cache reset,
every replica's adapters loaded or unloaded.

Faults: a request that cannot reach its replica (connection refused: nothing
started there) is sent to another; one in flight to a replica that dies or
hangs ends with an OpenAI-shaped 503 (``code: replica_down``) as soon as the
watch marks it down, a stream with that error as its last event. The others
carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.core.block_hash import hash_request_tokens
from pagedllm.entrypoints.openai.common import routes, sse
from pagedllm.entrypoints.openai.common.routes import ROUTED_PATHS
from pagedllm.entrypoints.openai.common.state import presented_key, tenant_of_key
from pagedllm.entrypoints.router.metrics_merge import merge_expositions
from pagedllm.fleet.prefix_index import PrefixIndex
from pagedllm.entrypoints.router.replica import Replica, ReplicaWatch, now, refresh_adapters, stop_watches
from pagedllm.entrypoints.router.request_prefix import routing_lora_name, routing_salt, routing_token_ids
from pagedllm.entrypoints.router.response_homes import SNIFF_BYTES, ResponseHomes
from pagedllm.fleet.routing import ReplicaLoad, RouteDecision, RoutingPolicy
from pagedllm.logger import init_logger

logger = init_logger(__name__)

# Headers that describe one hop's connection, not the message (RFC 9110 7.6.1), and the length httpx recomputes.
_HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                          "proxy-authorization", "proxy-authenticate", "content-length"})


class ReplicaDown(Exception):
    pass


@dataclass
class RouterState:
    """Everything the router's routes share; all of it lives on the event loop's thread."""

    replicas: list[Replica]
    policy: RoutingPolicy
    tokenizer: Any
    fingerprint: str
    chat_template: str | None = None
    api_keys: dict[str, str | None] = field(default_factory=dict)  # key -> tenant, for the tenants' salts
    health_interval_s: float = 0.5
    index: PrefixIndex = field(default_factory=PrefixIndex)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # Requests without a prompt (tokenize, kv_pool, ...) are spread by load, ties in turn.
    spread: RoutingPolicy = field(default_factory=lambda: RoutingPolicy("least-load"))
    response_homes: ResponseHomes = field(default_factory=ResponseHomes)

    def __post_init__(self) -> None:
        labels = ["replica"]
        self.routed = Counter("pagedllm:router_requests_routed", "Requests sent to each replica, by the reason "
                              "the policy chose it", labels + ["reason"], registry=self.registry)
        self.hit_tokens = Counter("pagedllm:router_prefix_hit_tokens", "Prompt tokens the chosen replica held "
                                  "cached (or was just sent) when a request was routed", labels, registry=self.registry)
        self.failed = Counter("pagedllm:router_requests_failed", "Requests ended with a 503 because their replica "
                              "went down", labels, registry=self.registry)
        self.up_gauge = Gauge("pagedllm:router_replica_up", "1 while the replica answers /health", labels,
                              registry=self.registry)
        self.in_flight_gauge = Gauge("pagedllm:router_requests_in_flight", "Requests sent to the replica and not "
                                     "finished", labels, registry=self.registry)
        self.index_gauge = Gauge("pagedllm:router_index_block_hashes", "Distinct block hashes the router knows a "
                                 "replica holds", registry=self.registry)

    def up_replicas(self, excluding: set[int] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas if r.up and r.index not in excluding]

    def choose(self, path: str, body: Any, tenant: str | None, excluding: set[int],
               method: str = "POST") -> tuple[Replica, RouteDecision]:
        candidates = self.up_replicas(excluding)
        if not candidates:
            raise ReplicaDown("no replica is up")
        home = self.response_homes.home_of(method, path, body)
        if home is not None and any(r.index == home for r in candidates):
            # the replica that stored the response the request reads; no other one has it
            decision = RouteDecision(home, 0, "response-home")
            self.routed.labels(str(home), decision.reason).inc()
            return self.replicas[home], decision
        hashes = self.routing_hashes(path, body, tenant, candidates[0]) if path in ROUTED_PATHS else []
        loads = [ReplicaLoad(r.index, r.in_flight, r.kv_usage) for r in candidates]
        if path in ROUTED_PATHS:
            decision = self.policy.choose(loads, hashes, self.index, now())
        else:  # not a generation: no prompt to place, only load to spread
            decision = self.spread.choose(loads, [], self.index, now())
        replica = self.replicas[decision.replica]
        self.routed.labels(str(replica.index), decision.reason).inc()
        self.hit_tokens.labels(str(replica.index)).inc(decision.hit_blocks * replica.block_size)
        return replica, decision

    def routing_hashes(self, path: str, body: Any, tenant: str | None, replica: Replica) -> list[int]:
        """The block hashes of the body's prompt as ``replica`` keys them: its block size, the
        tenant's salt, and for a LoRA request the adapter's name and fingerprint (replicas of
        one fleet serve the same model and adapters, so one replica's answer serves all)."""
        token_ids = routing_token_ids(path, body, self.tokenizer, self.chat_template)
        lora_name = routing_lora_name(body, replica.model_names)
        fingerprint = replica.lora_fingerprints.get(lora_name, "") if lora_name is not None else ""
        return hash_request_tokens(token_ids, replica.block_size, routing_salt(body, tenant), lora_name, fingerprint)

    def tenant_of(self, request: Request) -> str | None:
        """The tenant of the request's key, read as the replicas read it (they check the key)."""
        return tenant_of_key(self.api_keys, presented_key(request))[1]

    def refresh_gauges(self) -> None:
        for replica in self.replicas:
            self.up_gauge.labels(str(replica.index)).set(1 if replica.up else 0)
            self.in_flight_gauge.labels(str(replica.index)).set(replica.in_flight)
        self.index_gauge.set(self.index.size()[0])


def error_response(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_down"}}
    return sse.data_event(body).encode()


async def _unless_down(awaitable: Any, replica: Replica) -> Any:
    """``awaitable``'s result, or ``ReplicaDown`` as soon as the replica is marked down."""
    work = asyncio.ensure_future(awaitable)
    down = asyncio.ensure_future(replica.down.wait())
    try:
        finished, _ = await asyncio.wait({work, down}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        down.cancel()
    if work in finished:
        return work.result()
    work.cancel()
    raise ReplicaDown(f"replica {replica.url} went down: {replica.last_error}")


def build_router_app(state: RouterState, client: httpx.AsyncClient | None = None) -> FastAPI:
    """The router's app; its lifespan starts one watch per replica and stops them."""
    http = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0), limits=httpx.Limits(
        max_connections=None, max_keepalive_connections=256))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        context = zmq.asyncio.Context()
        watches = [asyncio.create_task(ReplicaWatch(replica, state.index, http, state.fingerprint, context,
                                                    state.health_interval_s).run())
                   for replica in state.replicas]
        try:
            yield
        finally:
            await stop_watches(watches)
            await http.aclose()
            context.term()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    _add_own_routes(app, state, http)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def pass_through(path: str, request: Request) -> Response:
        return await forward(state, http, request)

    return app


def _add_own_routes(app: FastAPI, state: RouterState, http: httpx.AsyncClient) -> None:
    @app.get(routes.HEALTH)
    async def health() -> Response:
        up = len(state.up_replicas())
        if up == 0:
            return error_response(503, "no replica is up", "no_replica")
        return JSONResponse({"status": "ok", "replicas_up": up, "replicas": len(state.replicas)})

    @app.get(routes.MODELS)
    async def models(request: Request) -> Response:
        answers = await asyncio.gather(*(http.get(f"{r.url}{routes.MODELS}", headers=_forwarded_headers(request),
                                                  timeout=5.0) for r in state.up_replicas()),
                                       return_exceptions=True)
        merged: dict[str, dict] = {}
        for answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code != 200:
                return Response(answer.content, answer.status_code, media_type="application/json")
            if isinstance(answer, httpx.Response):
                for model in answer.json().get("data", []):
                    merged.setdefault(model["id"], model)
        return JSONResponse({"object": "list", "data": list(merged.values())})

    @app.post(routes.RESET_PREFIX_CACHE)
    async def reset_prefix_cache(request: Request) -> Response:
        """Every replica's cache, not one's: the sum of the blocks they dropped."""
        answers, refusal = await _post_to_every_replica(state, http, request, 30.0)
        return refusal or JSONResponse({"dropped_blocks": sum(answer.json()["dropped_blocks"] for answer in answers)})

    @app.post(routes.LOAD_LORA_ADAPTER)
    @app.post(routes.UNLOAD_LORA_ADAPTER)
    async def lora_adapter(request: Request) -> Response:
        """Every replica loads (unloads) the adapter, so a request naming it may go to any
        of them; the first refusal is the answer. A replica down meanwhile misses it (one
        that restarts serves its --lora-modules)."""
        if not state.up_replicas():
            return error_response(503, "no replica is up", "no_replica")
        answers, refusal = await _post_to_every_replica(state, http, request, 300.0)
        # The adapters' fingerprints at once, so the next requests for this one hash as the replicas key them.
        await asyncio.gather(*(refresh_adapters(r, http) for r in state.up_replicas()), return_exceptions=True)
        return refusal or Response(answers[0].content, 200, media_type=answers[0].headers.get("content-type"))

    @app.get(routes.METRICS)
    async def metrics() -> Response:
        up = state.up_replicas()
        answers = await asyncio.gather(*(http.get(f"{r.url}{routes.METRICS}", timeout=10.0) for r in up),
                                       return_exceptions=True)
        texts = {str(r.index): a.text for r, a in zip(up, answers) if isinstance(a, httpx.Response)}
        state.refresh_gauges()
        own = generate_latest(state.registry).decode()
        return Response(own + merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)


async def _post_to_every_replica(state: RouterState, http: httpx.AsyncClient, request: Request,
                                 timeout_s: float) -> tuple[list[httpx.Response], Response | None]:
    """POST the request's path and body to every replica that is up: their answers,
    and what to answer instead, if anything (a 503 when one could not be reached, else
    the first refusal as the replica gave it)."""
    raw, path = await request.body(), request.url.path
    answers = await asyncio.gather(*(http.post(f"{r.url}{path}", headers=_forwarded_headers(request), content=raw,
                                               timeout=timeout_s) for r in state.up_replicas()),
                                   return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException):
            return [], error_response(503, f"a replica failed to answer {path}: {answer!r}", "replica_down")
        if answer.status_code != 200:
            return [], Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
    return answers, None


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: value for name, value in request.headers.items() if name.lower() not in _HOP_HEADERS}


async def forward(state: RouterState, http: httpx.AsyncClient, request: Request) -> Response:
    """Send ``request`` to a replica and answer with what it answers."""
    raw = await request.body()
    path = request.url.path
    body = None
    if path in ROUTED_PATHS and raw:  # only a generation's prompt is read; anything else is relayed as bytes
        try:
            body = json.loads(raw)
        except ValueError:
            pass  # the replica answers it with its own 400
    tried: set[int] = set()
    while True:
        try:
            replica, _ = state.choose(path, body, state.tenant_of(request), tried, request.method)
        except ReplicaDown as exc:
            return error_response(503, str(exc), "no_replica")
        upstream = http.build_request(request.method, f"{replica.url}{path}", params=request.query_params,
                                      headers=_forwarded_headers(request), content=raw)
        replica.in_flight += 1
        try:
            response = await _unless_down(http.send(upstream, stream=True), replica)
        except httpx.ConnectError:  # nothing reached the replica: another one may take it
            replica.in_flight -= 1
            tried.add(replica.index)
            continue
        except (ReplicaDown, httpx.HTTPError) as exc:
            replica.in_flight -= 1
            state.failed.labels(str(replica.index)).inc()
            return error_response(503, f"replica {replica.url} failed: {exc}", "replica_down")
        return await _answer(state, replica, response, path)


async def _answer(state: RouterState, replica: Replica, response: httpx.Response, path: str) -> Response:
    # httpx hands over decoded bytes, so the replica's content-encoding no longer applies.
    headers = {name: value for name, value in response.headers.items() if name.lower() not in _HOP_HEADERS
               and name.lower() != "content-encoding"}
    if response.headers.get("content-type", "").startswith(sse.MEDIA_TYPE):
        relay = _relay(state, replica, response, path)
        # Started here, so its cleanup (in_flight, the upstream stream) runs even if the client
        # leaves before Starlette iterates the body: asyncio finalizes a started generator.
        first = await anext(relay, b"")
        return StreamingResponse(_prepended(first, relay), status_code=response.status_code, headers=headers)
    try:
        content = await _unless_down(response.aread(), replica)
    except (ReplicaDown, httpx.HTTPError) as exc:
        state.failed.labels(str(replica.index)).inc()
        return error_response(503, f"replica {replica.url} failed: {exc}", "replica_down")
    finally:
        replica.in_flight -= 1
        await response.aclose()
    state.response_homes.learn(path, replica.index, content[:SNIFF_BYTES])
    return Response(content, response.status_code, headers=headers)


async def _prepended(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


async def _relay(state: RouterState, replica: Replica, response: httpx.Response,
                 path: str) -> AsyncIterator[bytes]:
    """The replica's stream, chunk by chunk; if the replica goes down, the error
    event its own engine would send, then the end. Closing it (the client went
    away) closes the upstream stream, so the replica aborts the request. A
    Responses stream's id is learned from its first bytes (``response_homes``)."""
    chunks = response.aiter_bytes()
    head = b"" if path == routes.RESPONSES else None
    try:
        while True:
            try:
                chunk = await _unless_down(chunks.__anext__(), replica)
            except StopAsyncIteration:
                return
            except (ReplicaDown, httpx.HTTPError) as exc:
                state.failed.labels(str(replica.index)).inc()
                yield _sse_error(f"replica {replica.url} failed: {exc}")
                return
            if head is not None:
                head += chunk
                if state.response_homes.learn(path, replica.index, head) or len(head) >= SNIFF_BYTES:
                    head = None
            yield chunk
    finally:
        replica.in_flight -= 1
        await response.aclose()

"""Sending a run's requests on their Poisson schedule and timing each one."""

from __future__ import annotations

import asyncio
import math
import random
import time

import httpx

from pagedllm.bench.serve.results import RequestMetrics, ServeResult, summarize
from pagedllm.bench.serve.stream import (MAX_ERROR_CHARS, RequestFailed, completion_body, error_body_message,
                                         stream_completion)
from pagedllm.bench.throughput import BenchRequest


def arrival_offsets(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times, in seconds after the start, of ``num`` requests arriving as a Poisson process.

    The first request goes at 0; each next one follows after an exponential gap of mean
    ``1 / request_rate`` drawn from ``random.Random(seed)``, so a seed gives the same schedule
    every time. ``request_rate=inf`` sends every request at 0. The rate must be positive.
    """
    if not request_rate > 0:  # written this way round so NaN is refused too
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets: list[float] = []
    now = 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets



async def send_request(client: httpx.AsyncClient, url: str, model: str, request: BenchRequest) -> RequestMetrics:
    """Send one request and time it from just before the POST. Never raises: any failure is
    recorded in the returned metrics' ``error``."""
    metrics = RequestMetrics(prompt_tokens=len(request.prompt_token_ids))
    start = time.perf_counter()
    try:
        tally = await stream_completion(client, url, completion_body(model, request))
    except RequestFailed as exc:
        metrics.error = str(exc)
        return metrics
    except Exception as exc:  # a load generator reports a broken request and carries on with the rest
        metrics.error = f"{type(exc).__name__}: {exc}"
        return metrics
    metrics.output_tokens = tally.output_tokens
    metrics.e2e_s = tally.done_at - start
    if tally.first_token_at is not None:
        metrics.ttft_s = tally.first_token_at - start
    return metrics


async def send_in_slot(
    slots: asyncio.Semaphore | None, client: httpx.AsyncClient, url: str, model: str, request: BenchRequest
) -> RequestMetrics:
    """``send_request`` once one of ``slots`` is free (at once when there is no limit)."""
    if slots is None:
        return await send_request(client, url, model, request)
    async with slots:
        return await send_request(client, url, model, request)


async def fetch_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists (``data[0].id`` of ``GET /v1/models``); ValueError when
    the server cannot be reached or lists none."""
    url = f"{base_url}/v1/models"
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ValueError(f"GET {url}: HTTP {response.status_code}: {error_body_message(response.content)}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"GET {url} lists no model: {response.text[:MAX_ERROR_CHARS]}") from exc


def make_client(api_key: str | None) -> httpx.AsyncClient:
    """An HTTP client that adds no delay of its own to what it measures."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        # Under heavy load the first token may take minutes to come, which is a result to
        # measure, not an error; only a server that does not accept the connection is given up on.
        timeout=httpx.Timeout(None, connect=30.0),
        # httpx queues requests beyond 100 connections by default, which would add client-side
        # waiting to the server's TTFT.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        # A proxy from the environment would add its own latency to every figure.
        trust_env=False,
    )


def run_serve_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    request_rate: float,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    max_concurrency: int | None = None,
) -> ServeResult:
    """Send ``requests`` to ``base_url`` at ``request_rate`` requests/s (Poisson arrivals, see
    ``arrival_offsets``) and measure them. ``model=None`` uses the first model the server lists.
    With ``max_concurrency`` at most that many requests are in flight; a request that waits for a
    free slot is timed from when it is sent, not from its arrival. The duration runs from the
    first send to the last completion. Failed requests are counted, not raised; ValueError for
    bad arguments or a server whose model list cannot be read. Runs its own event loop, so call
    it from synchronous code."""
    if not requests:
        raise ValueError("no requests to send")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, seed)
    model, metrics, duration = asyncio.run(
        _send_on_schedule(base_url.rstrip("/"), list(zip(requests, offsets)), model, api_key, max_concurrency)
    )
    return summarize(model, request_rate, metrics, duration)


async def _send_on_schedule(
    base_url: str, schedule: list[tuple[BenchRequest, float]], model: str | None, api_key: str | None,
    max_concurrency: int | None,
) -> tuple[str, list[RequestMetrics], float]:
    """Send each request at its offset in seconds; the model used, each request's metrics
    and the seconds from the first send to the last completion."""
    url = f"{base_url}/v1/completions"
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_client(api_key) as client:
        if model is None:
            model = await fetch_model_id(client, base_url)
        start = time.perf_counter()
        tasks = []
        for request, offset in schedule:
            # Sleeping to an absolute send time keeps the schedule from drifting by the loop's own delays.
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_in_slot(slots, client, url, model, request)))
        metrics = await asyncio.gather(*tasks)
        return model, list(metrics), time.perf_counter() - start

"""`pagedllm bench serve`: an online load generator for an OpenAI-compatible server.

Requests arrive as a Poisson process at a chosen rate and stream their completions back; for each
request the client measures the time to first token (TTFT), the time per output token after the
first (TPOT) and the end-to-end latency (e2e). The benchmark only talks HTTP, so it never loads the
model and works against any server that speaks ``/v1/completions`` with streaming.

httpx is imported when a client is made: the ``pagedllm`` command line imports this module to
build its ``bench serve`` flags, and every other command (a first ``generate``) would pay ~0.15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.bench.record import append_result
from pagedllm.bench.throughput import BenchRequest, load_requests, random_requests

if TYPE_CHECKING:
    import httpx

# Enough failure messages to tell what went wrong without flooding the report.
MAX_KEPT_ERRORS = 5
# Error bodies that are not OpenAI JSON (an HTML page from a proxy, say) are cut to this length.
MAX_ERROR_CHARS = 300


class RequestFailed(Exception):
    """A request the server refused or broke off; the message says why."""


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


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``p`` percent of ``values`` at or
    below it (so it is always one of the values, and p50 <= p90 <= p99). NaN when there are no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p * len(ordered) / 100))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LatencyStats:
    """Mean and nearest-rank percentiles of one latency, in seconds (NaN when nothing was measured)."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        mean = sum(values) / len(values) if values else math.nan
        return cls(mean, percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass
class RequestMetrics:
    """What the client saw of one request. ``error`` is set when it failed, and then only
    ``prompt_tokens`` is meaningful. ``ttft_s`` is None when the stream carried no text at all."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``; None for
        failed requests and for those with fewer than two output tokens (no gap to measure)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServeResult:
    """One benchmark run at one request rate. Token totals and latency statistics cover the
    completed requests only; failed ones are counted in ``num_failed`` and the first
    ``MAX_KEPT_ERRORS`` of their messages are kept in ``errors``."""

    model: str
    request_rate: float
    num_requests: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    errors: list[str]
    requests: list[RequestMetrics] = field(repr=False)

    @property
    def num_completed(self) -> int:
        return self.num_requests - self.num_failed

    @property
    def request_throughput(self) -> float:
        """Completed requests per second of wall time."""
        return self.num_completed / self.duration_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.total_output_tokens / self.duration_s


def summarize(model: str, request_rate: float, metrics: list[RequestMetrics], duration_s: float) -> ServeResult:
    """Fold per-request metrics into a ``ServeResult`` (statistics over completed requests only)."""
    done = [m for m in metrics if m.ok]
    failed = [m for m in metrics if not m.ok]
    return ServeResult(
        model=model,
        request_rate=request_rate,
        num_requests=len(metrics),
        num_failed=len(failed),
        duration_s=duration_s,
        total_prompt_tokens=sum(m.prompt_tokens for m in done),
        total_output_tokens=sum(m.output_tokens for m in done),
        ttft=LatencyStats.of([m.ttft_s for m in done if m.ttft_s is not None]),
        tpot=LatencyStats.of([m.tpot_s for m in done if m.tpot_s is not None]),
        e2e=LatencyStats.of([m.e2e_s for m in done if m.e2e_s is not None]),
        errors=[str(m.error) for m in failed[:MAX_KEPT_ERRORS]],
        requests=metrics,
    )


def openai_error_message(data: object) -> str:
    """The message of an OpenAI error object ``{"error": {"message": ...}}`` (or of a bare
    ``{"message": ...}``); anything else is returned as JSON text, cut to ``MAX_ERROR_CHARS``."""
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return json.dumps(data)[:MAX_ERROR_CHARS]


def error_body_message(body: bytes) -> str:
    """The message of an error response body: OpenAI JSON when it parses, else the raw text, cut."""
    try:
        return openai_error_message(json.loads(body))
    except ValueError:
        return body.decode("utf-8", errors="replace")[:MAX_ERROR_CHARS]


class StreamTally:
    """Reads the Server-Sent Events lines of one streamed completion.

    Rules: only ``data:`` lines count (blank lines, ``:`` comments and ``event:`` lines are
    skipped); ``data: [DONE]`` ends the stream. A chunk whose ``choices[0].text`` is non-empty is
    a token event, and the first one's time is the first-token time. ``usage.completion_tokens``
    (sent in the last chunk when ``stream_options.include_usage`` is on) is the output token
    count; without it the number of token events is used instead, which is only an estimate since
    a chunk may carry several tokens, or none while a multi-byte character is incomplete. A chunk
    with an ``error`` key (a server failing mid-stream) raises ``RequestFailed``.
    """

    def __init__(self) -> None:
        self.first_token_at: float | None = None
        self.done_at: float | None = None
        self.text_chunks = 0
        self.usage_tokens: int | None = None

    @property
    def done(self) -> bool:
        return self.done_at is not None

    @property
    def output_tokens(self) -> int:
        return self.text_chunks if self.usage_tokens is None else self.usage_tokens

    def feed(self, line: str, now: float) -> None:
        """Take one line received at ``now`` (a ``time.perf_counter()`` value)."""
        if not line.startswith("data:"):
            return
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            self.done_at = now
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RequestFailed(f"error in stream: {openai_error_message(chunk)}")
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            self.text_chunks += 1
            if self.first_token_at is None:
                self.first_token_at = now
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])


def completion_body(model: str, request: BenchRequest) -> dict:
    """The ``/v1/completions`` body for one request: the prompt as token ids, greedy, exactly
    ``max_tokens`` tokens (``ignore_eos``), streamed with a final usage chunk."""
    return {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> StreamTally:
    """POST one streamed completion and read it to ``data: [DONE]``; raises ``RequestFailed``
    on a status other than 200 and on a stream that ends without ``[DONE]``."""
    tally = StreamTally()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {error_body_message(await response.aread())}")
        async for line in response.aiter_lines():
            tally.feed(line, time.perf_counter())
            if tally.done:
                break
    if not tally.done:
        raise RequestFailed("stream ended before data: [DONE]")
    return tally


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
    import httpx  # loaded with the client (see the module docstring)

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
    import httpx  # loaded here (see the module docstring)

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


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:.1f}"


def _s(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds:.2f}"


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_table(results: list[ServeResult]) -> str:
    """A markdown table, one row per result; latencies of runs with no completed request show "-"."""
    header = (
        "| rate (req/s) | requests | failed | req/s | output tok/s "
        "| TTFT mean (ms) | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) "
        "| TPOT mean (ms) | TPOT p50 (ms) | TPOT p90 (ms) | TPOT p99 (ms) "
        "| e2e mean (s) | e2e p99 (s) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        ttft, tpot = r.ttft, r.tpot
        lines.append(
            f"| {format_rate(r.request_rate)} | {r.num_requests} | {r.num_failed} | {r.request_throughput:.2f} "
            f"| {r.output_tokens_per_s:.1f} "
            f"| {_ms(ttft.mean)} | {_ms(ttft.p50)} | {_ms(ttft.p90)} | {_ms(ttft.p99)} "
            f"| {_ms(tpot.mean)} | {_ms(tpot.p50)} | {_ms(tpot.p90)} | {_ms(tpot.p99)} "
            f"| {_s(r.e2e.mean)} | {_s(r.e2e.p99)} |"
        )
    return "\n".join(lines)


def _positive_rate(text: str) -> float:
    """argparse type for a request rate: a positive float, "inf" included."""
    try:
        rate = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return rate


def _positive_int(text: str) -> int:
    """argparse type for a count that must be at least 1."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def build_arg_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``pagedllm bench serve`` flags to ``parser``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--dataset",
        default="random",
        help="'random', or a JSON file of {prompt_token_ids, max_tokens} (all of it is sent; "
        "--num-prompts, --input-len and --output-len apply to random only)",
    )
    parser.add_argument("--num-prompts", type=_positive_int, default=64)
    parser.add_argument("--input-len", type=_positive_int, default=128)
    parser.add_argument("--output-len", type=_positive_int, default=64)
    parser.add_argument(
        "--request-rate",
        type=_positive_rate,
        nargs="+",
        default=[float("inf")],
        help="requests/s of the Poisson arrivals, one run per value ('inf': all at once; default inf)",
    )
    parser.add_argument("--max-concurrency", type=_positive_int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    parser.add_argument(
        "--vocab-size",
        type=_positive_int,
        default=49152,
        help="token ids of random prompts are drawn below this (the bench does not load the model; default SmolLM2's)",
    )
    parser.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE")


def _requests_from_args(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The requests to send and a sentence describing them."""
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.seed)
        return requests, (
            f"{args.num_prompts} random-token prompts of {args.input_len} tokens, {args.output_len} output tokens each"
        )
    requests = load_requests(args.dataset)
    return requests, f"{len(requests)} requests from {args.dataset}"


def _print_failures(result: ServeResult) -> None:
    if result.num_failed:
        print(
            f"{result.num_failed} of {result.num_requests} requests failed at rate {format_rate(result.request_rate)}; "
            f"first errors:",
            file=sys.stderr,
        )
        for error in result.errors:
            print(f"  {error}", file=sys.stderr)


def main(args: argparse.Namespace) -> str:
    """Run one benchmark per ``--request-rate`` on the same requests, print the table (failures go
    to stderr), append it to ``--record`` when given, and return it."""
    requests, description = _requests_from_args(args)
    model = args.model
    results = []
    for rate in args.request_rate:
        result = run_serve_benchmark(
            args.base_url, requests, rate, model, args.api_key, args.seed, args.max_concurrency
        )
        # The model the first run found is reused, so every run names the same one.
        model = result.model
        _print_failures(result)
        results.append(result)
    table = format_table(results)
    print(table)
    if args.record:
        concurrency = args.max_concurrency or "unlimited"
        append_result(
            args.record,
            getattr(args, "argv", None),
            f"Server {args.base_url}, model {model}. {description}; Poisson arrivals (seed {args.seed}), "
            f"max concurrency {concurrency}. Percentiles are nearest-rank over completed requests.",
            table,
        )
    return table

"""`pagedllm bench soak`: a long randomized load against a live server.

The soak starts ``pagedllm serve`` as a child process on a free port
(``server_process.running_server``, so it can read the server's memory), then keeps ``--concurrency`` clients busy for
``--duration`` seconds with a mix of requests: streamed and plain completions,
chat completions, ``n`` = 2, stop strings, random prompt and output lengths.
A ``--abort-fraction`` of the streamed ones are cut off mid-stream by closing
the connection. Afterwards it waits for the server to drain and reports what a
server that leaks or degrades would get wrong: errors (any non-200 or broken
stream; must be 0), KV blocks in use after the drain (must be 0), and the
growth of the server's resident memory between the end of a warm-up and the
end of the run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.bench.server_process import running_server
from pagedllm.bench.tables import markdown_table

WARMUP_FRACTION = 0.1  # memory is measured from here: caches and pools are warm by then
WORDS = ("paging", "blocks", "memory", "cache", "tokens", "tables", "the", "a", "kernel", "request.")


@dataclass
class SoakResult:
    duration_s: float
    concurrency: int
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    blocks_in_use_after_drain: int = -1
    rss_after_warmup_mib: float = 0.0
    rss_at_end_mib: float = 0.0
    error_samples: list[str] = field(default_factory=list)

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_at_end_mib - self.rss_after_warmup_mib


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` in ``/metrics`` output (a counter's name
    ends in ``_total``), parsed by prometheus_client: summed over the series
    whose labels include ``labels`` (one series per served model here)."""
    values = [sample.value for family in text_string_to_metric_families(metrics_text) for sample in family.samples
              if sample.name == name and labels.items() <= sample.labels.items()]
    if not values:
        raise ValueError(f"/metrics has no {name} with labels {labels}")
    return sum(values)


def random_body(rng: random.Random, model: str) -> tuple[str, dict]:
    """(path, JSON body) of one random request."""
    max_tokens = rng.randint(1, 48)
    kind = rng.choice(["completion", "completion", "chat", "n2", "stop"])
    text = " ".join(rng.choice(WORDS) for _ in range(int(8 * 2 ** rng.uniform(0, 5))))  # 8-256 words
    if kind == "chat":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": rng.choice([0.0, 0.7]), "stream": rng.random() < 0.7,
        }
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": rng.random() < 0.7,
            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(2**31)}
    if kind == "n2":
        body["n"] = 2
    if kind == "stop":
        body["stop"] = [" the", "."]
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, abort_fraction: float,
                      result: SoakResult) -> None:
    path, body = random_body(rng, model)
    abort_after = rng.randint(1, 8) if body["stream"] and rng.random() < abort_fraction else None
    try:
        if not body["stream"]:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            response.json()["choices"]  # a body that is not a completion is an error too
            result.completed += 1
            return
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            chunks = 0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    result.completed += 1
                    return
                if line.startswith("data: "):
                    chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        result.aborted += 1  # leaving the block closes the connection mid-stream
                        return
            raise RuntimeError("stream ended before data: [DONE]")
    except Exception as exc:  # a soak counts failures and carries on
        result.errors += 1
        if len(result.error_samples) < 5:
            result.error_samples.append(f"{path}: {type(exc).__name__}: {exc}")


async def drive(base_url: str, duration_s: float, concurrency: int, abort_fraction: float, seed: int,
                server_pid: int) -> SoakResult:
    result = SoakResult(duration_s=duration_s, concurrency=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        deadline = start + duration_s
        warmed = False

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.perf_counter() < deadline:
                await one_request(client, rng, model, abort_fraction, result)

        async def watch_warmup() -> None:
            nonlocal warmed
            await asyncio.sleep(duration_s * WARMUP_FRACTION)
            result.rss_after_warmup_mib = rss_mib(server_pid)
            warmed = True

        await asyncio.gather(watch_warmup(), *(worker(i) for i in range(concurrency)))
        if not warmed:
            raise RuntimeError("the soak ended before its warm-up")
        # Drain: aborted streams are noticed by the server within a step or two.
        for _ in range(300):
            text = (await client.get("/metrics")).text
            busy = metric_value(text, "pagedllm:num_requests_running") + metric_value(
                text, "pagedllm:num_requests_waiting")
            if busy == 0:
                break
            await asyncio.sleep(0.1)
        result.blocks_in_use_after_drain = int(metric_value(text, "pagedllm:kv_cache_used_blocks"))
        result.rss_at_end_mib = rss_mib(server_pid)
        result.duration_s = time.perf_counter() - start
    return result


def run_soak(duration_s: float, concurrency: int, abort_fraction: float, seed: int,
             server_args: list[str]) -> SoakResult:
    """Start a server with ``server_args``, soak it, stop it."""
    with running_server(server_args) as (base_url, pid):
        return asyncio.run(drive(base_url, duration_s, concurrency, abort_fraction, seed, pid))


def format_table(result: SoakResult) -> str:
    return markdown_table(
        ["duration (s)", "clients", "completed", "aborted", "errors", "blocks in use after drain",
         "server RSS after warm-up (MiB)", "at end (MiB)", "growth (MiB)"],
        [[f"{result.duration_s:.0f}", result.concurrency, result.completed, result.aborted, result.errors,
          result.blocks_in_use_after_drain, f"{result.rss_after_warmup_mib:.0f}", f"{result.rss_at_end_mib:.0f}",
          f"{result.rss_growth_mib:+.0f}"]])

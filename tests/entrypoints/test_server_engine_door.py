"""The server reaches the engine only through ``AsyncLLMEngine``, whose
operations on the pool run between steps under its lock: resetting the prefix
cache and reading the pool while 32 streams decode never overlaps a step,
breaks no invariant (``--debug-invariants`` checks them all after every step),
changes no token and gives snapshots whose blocks agree with their own counters."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.entrypoints.live_server import uvicorn_thread

NUM_STREAMS = 32
BLOCK_SIZE = 16
# Four families of prompts sharing three full blocks each, so finished requests leave
# cached blocks that later ones revive (and that the resets drop).
SHARED_PREFIXES = [[1000 + 97 * family + i for i in range(3 * BLOCK_SIZE)] for family in range(4)]
MAX_HAMMER_CALLS = 400  # per loop: a bound even if the streams hang
RUN_TIMEOUT_S = 120.0


def stream_bodies() -> list[dict]:
    """Greedy completions of different lengths, so requests finish (and free
    blocks) while others still decode and queued ones start."""
    return [{"prompt": SHARED_PREFIXES[i % 4] + [2000 + 13 * i + j for j in range(5)],
             "max_tokens": 12 + 4 * (i % 8), "temperature": 0, "ignore_eos": True, "stream": True}
            for i in range(NUM_STREAMS)]


@dataclass
class LoudRun:
    """What the hammering loops saw."""

    statuses: list[int] = field(default_factory=list)  # of every reset and pool read
    dropped_blocks: int = 0  # summed over the resets
    torn_snapshots: list[str] = field(default_factory=list)  # pool reads whose blocks disagree with their counters


class StepWatch:
    """Counts the pool operations that ran while ``engine.step`` was running in
    the engine's thread (the race the lock exists to prevent)."""

    def __init__(self) -> None:
        self.stepping = threading.Event()
        self.calls = self.during_step = 0

    def around_step(self, step: Callable) -> Callable:
        def watched_step(*args, **kwargs):
            self.stepping.set()
            try:
                return step(*args, **kwargs)
            finally:
                self.stepping.clear()

        return watched_step

    def around_pool_operation(self, operation: Callable) -> Callable:
        def watched_operation(*args, **kwargs):
            self.calls += 1
            self.during_step += self.stepping.is_set()
            return operation(*args, **kwargs)

        return watched_operation


async def stream_text(client: httpx.AsyncClient, body: dict) -> str:
    """The streamed text and finish reason; a stream cut short (the engine died) says so."""
    text, reason = [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"<HTTP {response.status_code}: {(await response.aread()).decode()[:200]}>"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return "".join(text) + f"<{reason}>"
                if line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    reason = choice["finish_reason"] or reason
    except httpx.HTTPError as exc:
        return f"<cut: {exc!r}>"
    return "<no [DONE]>"


def snapshot_disagreement(snapshot: dict) -> str | None:
    """Why a /v1/kv_pool answer is torn (its blocks and its counters from different moments), or None."""
    states = [block["state"] for block in snapshot["blocks"]]
    counters = snapshot["counters"]
    seen = {"used": states.count("used"), "not used": states.count("cached") + states.count("free"),
            "hashed": sum(block["hashed"] for block in snapshot["blocks"])}
    claimed = {"used": counters["blocks_in_use"], "not used": counters["free_blocks"],
               "hashed": counters["cached_blocks"]}
    return None if seen == claimed else f"blocks say {seen}, counters say {claimed}"


async def hammer(client: httpx.AsyncClient, method: str, path: str, done: asyncio.Event, run: LoudRun) -> None:
    for _ in range(MAX_HAMMER_CALLS):
        if done.is_set():
            return
        response = await client.request(method, path)
        run.statuses.append(response.status_code)
        if response.status_code != 200:
            continue
        if path == "/reset_prefix_cache":
            run.dropped_blocks += response.json()["dropped_blocks"]
        elif (why := snapshot_disagreement(response.json())) is not None:
            run.torn_snapshots.append(why)


async def run_streams(base: str, loud: LoudRun | None) -> list[str]:
    """Every stream's text; with ``loud``, two loops reset the prefix cache and two read
    the pool until the streams are done."""
    limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        done = asyncio.Event()
        loops = [] if loud is None else [
            asyncio.create_task(hammer(client, method, path, done, loud))
            for method, path in [("POST", "/reset_prefix_cache"), ("GET", "/v1/kv_pool")] * 2]
        try:
            return list(await asyncio.gather(*(stream_text(client, body) for body in stream_bodies())))
        finally:
            done.set()
            await asyncio.gather(*loops)


def test_resets_and_pool_reads_under_load_wait_for_the_step(serve, monkeypatch):
    app, options, made = serve("--host", "127.0.0.1", "--port", "0", "--num-kv-blocks", "512",
                               "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "16", "--debug-invariants",
                               "--uvicorn-log-level", "warning")
    with uvicorn_thread(app, options) as server:
        base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        quiet = asyncio.run(asyncio.wait_for(run_streams(base, None), RUN_TIMEOUT_S))
        httpx.post(f"{base}/reset_prefix_cache")  # the loud run starts as cold as the quiet one
        engine, watch = made[0].llm_engine, StepWatch()
        monkeypatch.setattr(engine, "step", watch.around_step(engine.step))
        for name in ("reset_prefix_cache", "pool_snapshot"):
            monkeypatch.setattr(engine.kv_cache_manager, name,
                                watch.around_pool_operation(getattr(engine.kv_cache_manager, name)))
        loud = LoudRun()
        hammered = asyncio.run(asyncio.wait_for(run_streams(base, loud), RUN_TIMEOUT_S))
        health = httpx.get(f"{base}/health")
    failed_streams = [i for i, text in enumerate(hammered) if not text.endswith("<length>")]
    summary = (f"{len(loud.statuses)} resets and pool reads, {watch.during_step} of {watch.calls} during a step, "
               f"non-200: {len(loud.statuses) - loud.statuses.count(200)}, dropped blocks {loud.dropped_blocks}, "
               f"torn snapshots {len(loud.torn_snapshots)} {loud.torn_snapshots[:2]}, streams cut or failed "
               f"{len(failed_streams)} {[hammered[i][-120:] for i in failed_streams[:2]]}, streams differing from "
               f"the quiet run {sum(a != b for a, b in zip(quiet, hammered))}, /health {health.status_code}")
    assert all(text.endswith("<length>") for text in quiet), quiet
    assert health.status_code == 200, summary  # a broken invariant kills the engine loop
    assert not failed_streams and hammered == quiet, summary
    assert loud.statuses and set(loud.statuses) == {200}, summary
    assert watch.calls == len(loud.statuses) and watch.during_step == 0, summary
    assert not loud.torn_snapshots, summary
    assert loud.dropped_blocks > 0, summary  # the resets had cached blocks to drop while requests ran

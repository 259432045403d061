"""Sending a fleet workload's turns as streamed chat completions and timing each one.

Each slot of the schedule is sent at its offset, or later when the conversation's
previous turn has not ended yet (its reply is part of this turn's messages). A
request is timed from its own send, so waiting for the previous turn is not counted
in its TTFT. The request rate, the send order and the messages' text do not depend
on the server; only the replies (and so the later turns' text) do.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from pagedllm.bench.fleet.workload import Slot, Workload
from pagedllm.bench.serve.client import fetch_model_id, make_client
from pagedllm.bench.serve.results import RequestMetrics
from pagedllm.bench.serve.stream import RequestFailed, SSEReader, read_stream

CHAT_PATH = "/v1/chat/completions"


@dataclass
class ChatMetrics(RequestMetrics):
    """``RequestMetrics`` and the prompt tokens the server found cached (``usage.prompt_tokens_details``)."""

    cached_tokens: int = 0


class ChatTally(SSEReader):
    """Reads one streamed chat completion: the reply's text, the first-token time (the first
    chunk whose ``delta.content`` is non-empty) and the final usage chunk's counts."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.usage: dict | None = None

    def take(self, chunk: dict, now: float) -> None:
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.text.append(content)
                self.first_token(now)
        if chunk.get("usage"):
            self.usage = chunk["usage"]


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """Greedy, exactly ``max_tokens`` tokens (``ignore_eos``), streamed with a final usage chunk."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict) -> ChatTally:
    tally = await read_stream(client, url, body, ChatTally())
    if tally.usage is None:
        raise RequestFailed("the stream carried no usage chunk")
    return tally


async def send_turn(client: httpx.AsyncClient, url: str, body: dict) -> tuple[ChatMetrics, str]:
    """One turn, timed from just before the POST: its metrics and its reply's text. Never
    raises: a failure is the metrics' ``error`` (and an empty reply, so the conversation goes on)."""
    metrics = ChatMetrics(prompt_tokens=0)
    start = time.perf_counter()
    try:
        tally = await stream_chat(client, url, body)
    except Exception as exc:  # a load generator reports a broken request and carries on with the rest
        metrics.error = str(exc) if isinstance(exc, RequestFailed) else f"{type(exc).__name__}: {exc}"
        return metrics, ""
    usage = tally.usage
    metrics.prompt_tokens = int(usage.get("prompt_tokens", 0))
    metrics.output_tokens = int(usage.get("completion_tokens", 0))
    metrics.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    metrics.e2e_s = tally.done_at - start
    if tally.first_token_at is not None:
        metrics.ttft_s = tally.first_token_at - start
    return metrics, "".join(tally.text)


@dataclass
class WorkloadRun:
    """What one server did with a workload: every slot's metrics (schedule order) and the seconds
    from the first send to the last completion."""

    model: str
    metrics: list[ChatMetrics]
    duration_s: float
    replies: dict[tuple[int, int], str]


def run_workload(base_url: str, workload: Workload, model: str | None = None) -> WorkloadRun:
    """Send ``workload`` to ``base_url`` and measure it (see the module docstring); synchronous."""
    return asyncio.run(_run(base_url.rstrip("/"), workload, model))


async def _run(base_url: str, workload: Workload, model: str | None) -> WorkloadRun:
    replies: dict[tuple[int, int], str] = {}
    ended = {(slot.conversation, slot.turn): asyncio.Event() for slot in workload.schedule}
    async with make_client(None) as client:
        model = model or await fetch_model_id(client, base_url)
        start = time.perf_counter()

        async def one(slot: Slot) -> ChatMetrics:
            await asyncio.sleep(max(0.0, start + slot.offset_s - time.perf_counter()))
            if slot.turn > 0:
                await ended[(slot.conversation, slot.turn - 1)].wait()
            conversation = workload.conversations[slot.conversation]
            messages = conversation.messages([replies[(slot.conversation, t)] for t in range(slot.turn)])
            metrics, replies[(slot.conversation, slot.turn)] = await send_turn(
                client, base_url + CHAT_PATH, chat_body(model, messages, workload.spec.max_tokens))
            ended[(slot.conversation, slot.turn)].set()
            return metrics

        metrics = await asyncio.gather(*(one(slot) for slot in workload.schedule))
        return WorkloadRun(model, list(metrics), time.perf_counter() - start, replies)


def warm_up(base_url: str, replicas: int, model: str | None = None) -> None:
    """One short untimed chat per replica, sent together (so a router spreads them)."""
    async def send_all() -> None:
        async with make_client(None) as client:
            name = model or await fetch_model_id(client, base_url)
            await asyncio.gather(*(send_turn(client, base_url + CHAT_PATH, chat_body(
                name, [{"role": "user", "content": f"Warm-up number {i}: say hello."}], 4)) for i in range(replicas)))
    asyncio.run(send_all())

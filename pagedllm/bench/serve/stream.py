"""One streamed ``/v1/completions`` request: its body, and the Server-Sent Events read
back and timed (``StreamTally``); failures are ``RequestFailed`` with the server's message."""

from __future__ import annotations

from abc import ABC, abstractmethod

import json
import time
from typing import TypeVar

import httpx

from pagedllm.bench.throughput import BenchRequest

# Error bodies that are not OpenAI JSON (an HTML page from a proxy, say) are cut to this length.
MAX_ERROR_CHARS = 300


class RequestFailed(Exception):
    """A request the server refused or broke off; the message says why."""



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


class SSEReader(ABC):
    """The lines of one OpenAI stream: ``feed`` each with its arrival time; the end
    (``[DONE]``) sets ``done_at``, and every chunk goes to ``take`` (a subclass's)."""

    def __init__(self) -> None:
        self.first_token_at: float | None = None
        self.done_at: float | None = None

    def feed(self, line: str, now: float) -> None:
        """Take one line received at ``now`` (a ``time.perf_counter()`` value)."""
        chunk = sse_data(line)
        if chunk is STREAM_DONE:
            self.done_at = now
        elif chunk is not None:
            self.take(chunk, now)

    @abstractmethod
    def take(self, chunk: dict, now: float) -> None:
        """One JSON chunk of the stream, received at ``now``."""

    def first_token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now


SSEReaderT = TypeVar("SSEReaderT", bound=SSEReader)


class StreamTally(SSEReader):
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
        super().__init__()
        self.text_chunks = 0
        self.usage_tokens: int | None = None

    @property
    def done(self) -> bool:
        return self.done_at is not None

    @property
    def output_tokens(self) -> int:
        return self.text_chunks if self.usage_tokens is None else self.usage_tokens

    def take(self, chunk: dict, now: float) -> None:
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            self.text_chunks += 1
            self.first_token(now)
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])


STREAM_DONE: dict = {}  # what ``sse_data`` returns for the closing ``data: [DONE]``


def sse_data(line: str) -> dict | None:
    """One server-sent-event line of an OpenAI stream: its JSON chunk, ``STREAM_DONE``
    for ``[DONE]``, None for any other line. A chunk with an ``error`` key (a server
    failing mid-stream) raises ``RequestFailed``."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return STREAM_DONE
    chunk = json.loads(payload)
    if "error" in chunk:
        raise RequestFailed(f"error in stream: {openai_error_message(chunk)}")
    return chunk


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
    return await read_stream(client, url, body, StreamTally())


async def read_stream(client: httpx.AsyncClient, url: str, body: dict, reader: SSEReaderT) -> SSEReaderT:
    """POST ``body`` to ``url`` and feed ``reader`` every line up to ``data: [DONE]``; raises
    ``RequestFailed`` on a status other than 200 and on a stream that ends without ``[DONE]``."""
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {error_body_message(await response.aread())}")
        async for line in response.aiter_lines():
            reader.feed(line, time.perf_counter())
            if reader.done_at is not None:
                break
    if reader.done_at is None:
        raise RequestFailed("stream ended before data: [DONE]")
    return reader

"""`pagedllm bench serve` against a fake OpenAI-compatible streaming server run in-process on loopback.

The fake server streams one chunk of text "x" per requested token, a short sleep apart, then a
usage chunk and ``data: [DONE]``; it refuses ``max_tokens`` above 50 with an OpenAI error body.
It records the bodies and headers it was sent and the most requests it had in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.bench.serve import cli
from pagedllm.bench.serve.client import arrival_offsets, run_serve_benchmark
from pagedllm.bench.serve.results import format_table, percentile
from pagedllm.bench.serve.stream import RequestFailed, StreamTally
from pagedllm.bench.throughput import BenchRequest

MODEL_ID = "fake-model"
MAX_TOKENS_LIMIT = 50
HOLD_TIMEOUT_S = 5.0
TOKEN_GAP_S = 0.01


@dataclass
class ServerLog:
    bodies: list[dict] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    # A stream's first token waits (up to HOLD_TIMEOUT_S) until this many streams have been
    # in flight at once, so a short request cannot end before the last one starts on a
    # slow machine; a client that sends one at a time still shows a peak of 1.
    hold_until_peak: int = 0


def make_fake_app(log: ServerLog) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        log.bodies.append(body)
        log.auth_headers.append(request.headers.get("authorization"))
        n = body["max_tokens"]
        if n > MAX_TOKENS_LIMIT:
            error = {
                "message": f"max_tokens {n} is more than {MAX_TOKENS_LIMIT}",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
            return JSONResponse(status_code=400, content={"object": "error", "error": error})

        async def events():
            log.in_flight += 1
            log.peak_in_flight = max(log.peak_in_flight, log.in_flight)
            held_until = time.monotonic() + HOLD_TIMEOUT_S
            while log.peak_in_flight < log.hold_until_peak and time.monotonic() < held_until:
                await asyncio.sleep(0.005)
            try:
                for _ in range(n):
                    await asyncio.sleep(TOKEN_GAP_S)
                    chunk = {"id": "cmpl-1", "object": "text_completion", "model": MODEL_ID,
                             "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                         "total_tokens": len(body["prompt"]) + n}
                yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                log.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server():
    """(base_url, log) of a fake server running in a background thread for this module."""
    log = ServerLog()
    port = free_loopback_port()
    server = uvicorn.Server(uvicorn.Config(make_fake_app(log), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    with httpx.Client(trust_env=False) as client:
        while True:
            try:
                if client.get(f"{base_url}/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
    yield base_url, log
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def server(fake_server):
    """The fake server with a fresh log for each test."""
    base_url, log = fake_server
    log.bodies.clear()
    log.auth_headers.clear()
    log.peak_in_flight = 0
    log.hold_until_peak = 0
    return base_url, log


def requests_of(max_tokens: list[int], prompt_len: int = 5) -> list[BenchRequest]:
    return [BenchRequest(list(range(100 + i, 100 + i + prompt_len)), n) for i, n in enumerate(max_tokens)]


def test_all_at_once_streams_every_token_and_sends_concurrently(server):
    base_url, log = server
    asked = [3, 5, 8, 10, 4, 6, 9, 7]
    log.hold_until_peak = len(asked)
    result = run_serve_benchmark(base_url, requests_of(asked), float("inf"), api_key="sekret")

    assert result.num_requests == len(asked) and result.num_failed == 0 and result.errors == []
    assert result.model == MODEL_ID  # found through /v1/models
    assert [m.output_tokens for m in result.requests] == asked
    assert result.total_output_tokens == sum(asked)
    assert result.total_prompt_tokens == 5 * len(asked)
    for m in result.requests:
        assert 0 < m.ttft_s < m.e2e_s
        # Tokens come about TOKEN_GAP_S apart; arrival jitters (timer slack, TCP
        # coalescing), so only a loose lower bound holds.
        assert m.tpot_s >= TOKEN_GAP_S * 0.3
    for stats in (result.ttft, result.tpot, result.e2e):
        assert stats.p50 <= stats.p90 <= stats.p99
    assert result.request_throughput == pytest.approx(len(asked) / result.duration_s)
    assert result.output_tokens_per_s == pytest.approx(sum(asked) / result.duration_s)

    # All in flight together: the run takes about as long as the slowest, far less than the sum.
    assert log.peak_in_flight == len(asked)
    assert result.duration_s < 0.5 * sum(m.e2e_s for m in result.requests)

    body = log.bodies[0]
    assert body["model"] == MODEL_ID and body["stream"] is True and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
    sent = sorted(tuple(r.prompt_token_ids) for r in requests_of(asked))
    assert sorted(tuple(b["prompt"]) for b in log.bodies) == sent
    assert set(log.auth_headers) == {"Bearer sekret"}


def test_poisson_arrivals_take_about_num_over_rate(server):
    base_url, _ = server
    num, rate = 20, 40.0
    result = run_serve_benchmark(base_url, requests_of([2] * num), rate, model=MODEL_ID, seed=3)
    assert result.num_failed == 0
    # The sends span 19 exponential gaps of mean 1/40 s (about 0.5 s); the bound is loose because
    # a sum of 19 such gaps varies by about a quarter.
    assert 0.3 * num / rate < result.duration_s < 3 * num / rate


def test_arrival_offsets_are_a_seeded_poisson_process():
    offsets = arrival_offsets(20_000, 50.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.05)
    assert arrival_offsets(10, 50.0, seed=1) == offsets[:10]
    assert arrival_offsets(4, float("inf")) == [0.0] * 4
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            arrival_offsets(4, bad)


def test_refused_request_is_counted_as_failed_with_its_message(server):
    base_url, _ = server
    result = run_serve_benchmark(base_url, requests_of([4, 60, 6]), float("inf"), model=MODEL_ID)
    assert result.num_requests == 3 and result.num_failed == 1 and result.num_completed == 2
    assert len(result.errors) == 1
    assert "HTTP 400" in result.errors[0] and "max_tokens 60 is more than 50" in result.errors[0]
    # Totals and throughput cover the completed requests only.
    assert result.total_output_tokens == 10 and result.total_prompt_tokens == 10
    assert result.request_throughput == pytest.approx(2 / result.duration_s)


def test_max_concurrency_one_runs_requests_one_after_another(server):
    base_url, log = server
    result = run_serve_benchmark(
        base_url, requests_of([4, 4, 4, 4]), float("inf"), model=MODEL_ID, max_concurrency=1
    )
    assert result.num_failed == 0
    assert log.peak_in_flight == 1
    # The requests' intervals do not overlap and all lie inside the run.
    assert result.duration_s >= sum(m.e2e_s for m in result.requests)


def test_unreachable_server():
    url = f"http://127.0.0.1:{free_loopback_port()}"  # nothing listens there
    with pytest.raises(ValueError, match="cannot reach"):
        run_serve_benchmark(url, requests_of([2]), float("inf"))
    # With the model given no lookup is made, and the connection errors are failures, not exceptions.
    result = run_serve_benchmark(url, requests_of([2, 2]), float("inf"), model=MODEL_ID)
    assert result.num_failed == 2 and result.num_completed == 0
    assert all("ConnectError" in e for e in result.errors)
    assert "| inf | 2 | 2 | 0.00 | 0.0 | - |" in format_table([result])


def test_stream_tally_rules():
    tally = StreamTally()
    lines = [
        ": keep-alive comment",
        "",
        'data: {"choices": [{"index": 0, "text": ""}]}',  # no text yet (half a UTF-8 character)
        'data: {"choices": [{"index": 0, "text": "ab"}]}',
        'data: {"choices": [{"index": 0, "text": "c"}]}',
        'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
        "data: [DONE]",
    ]
    for now, line in enumerate(lines):
        tally.feed(line, float(now))
    assert tally.first_token_at == 3.0 and tally.done_at == 6.0
    assert tally.text_chunks == 2 and tally.output_tokens == 4  # usage wins over the chunk count

    no_usage = StreamTally()
    for line in lines[3:5]:
        no_usage.feed(line, 0.0)
    assert not no_usage.done and no_usage.output_tokens == 2  # falls back to the text chunks

    with pytest.raises(RequestFailed, match="engine died"):
        StreamTally().feed('data: {"error": {"message": "engine died", "code": 500}}', 0.0)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 11)]
    # p25 of ten values is the 3rd (2.5 rounds up), p99 the 10th.
    assert [percentile(values, p) for p in (25, 50, 90, 99, 100)] == [3.0, 5.0, 9.0, 10.0, 10.0]
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_cli_runs_one_row_per_rate_and_records(server, tmp_path, capsys):
    base_url, log = server
    parser = argparse.ArgumentParser()
    cli.build_arg_parser(parser)
    record = tmp_path / "bench.md"
    argv = ["--base-url", base_url, "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
            "--request-rate", "inf", "100", "--vocab-size", "1000", "--record", str(record)]
    args = parser.parse_args(argv)
    args.argv = ["bench", "serve", *argv]
    assert args.request_rate == [float("inf"), 100.0]

    table = cli.main(args)

    rows = table.splitlines()
    assert len(rows) == 2 + 2  # header, separator, one row per rate
    assert rows[0].startswith("| rate (req/s) | requests | failed | req/s | output tok/s | TTFT mean (ms)")
    assert rows[2].startswith("| inf | 6 | 0 |") and rows[3].startswith("| 100 | 6 | 0 |")
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    assert table in capsys.readouterr().out
    # Both runs sent the same random prompts, drawn below --vocab-size.
    prompts = [b["prompt"] for b in log.bodies]
    assert len(prompts) == 12 and sorted(map(tuple, prompts[:6])) == sorted(map(tuple, prompts[6:]))
    assert all(len(p) == 4 and all(0 <= t < 1000 for t in p) for p in prompts)
    text = record.read_text()
    assert f"`pagedllm bench serve --base-url {base_url} --num-prompts 6" in text
    assert text.startswith("\n### ") and text.rstrip().endswith(rows[-1])


def test_cli_rejects_bad_rates():
    parser = argparse.ArgumentParser()
    cli.build_arg_parser(parser)
    for bad in ("0", "-2", "fast"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--request-rate", bad])


def launch_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.build_arg_parser(parser)
    args = parser.parse_args(list(argv))
    args.argv = ["bench", "serve", *argv]
    return args


@pytest.mark.slow
def test_launch_compares_the_servers_it_starts_with_offline(tiny_llama, tmp_path):
    """--launch starts both pagedllm servers in turn and --offline times LLM.generate first, all on
    the same requests and engine flags: every request completes, each row has its ratio to offline."""
    record = tmp_path / "bench.md"
    table = cli.main(launch_args("--launch", "pagedllm", "pagedllm-thread", "--offline", "--dataset", "mixed",
                                 "--num-prompts", "4", "--serve-args", f"--model {tiny_llama} --num-kv-blocks 128",
                                 "--record", str(record)))
    rows = table.splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == [
        "offline LLM.generate", "pagedllm serve", "pagedllm serve --no-engine-process"]
    assert all(row.split("|")[3].strip() == "0" for row in rows)  # no request failed
    assert rows[0].split("|")[-3].strip() == "1.00x" and all(row.split("|")[-3].strip().endswith("x") for row in rows)
    text = record.read_text()
    assert "Machine: " in text and "engine flags: --model" in text and text.rstrip().endswith(rows[-1])


def test_launch_refusals_say_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="unknown server 'vllm'"):
        cli.main(launch_args("--launch", "vllm"))
    with pytest.raises(ValueError, match="--launch llama-server needs --llama-server PATH"):
        cli.main(launch_args("--launch", "llama-server", "--llama-server", str(tmp_path / "none")))
    with pytest.raises(ValueError, match="--serve-args applies to the servers --launch starts"):
        cli.main(launch_args("--serve-args", "--dtype bfloat16"))
    with pytest.raises(ValueError, match="one --request-rate"):
        cli.main(launch_args("--launch", "pagedllm", "--request-rate", "1", "2"))

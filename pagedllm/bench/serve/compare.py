"""`pagedllm bench serve --launch ...`: the same requests, sent by the same client, to
servers this bench starts one after the other (``pagedllm serve`` with its engine core in
a process of its own, the same with the engine loop in a thread of the API server, and
llama.cpp's ``llama-server`` where a build is given), beside the offline figure of
``LLM.generate`` on those requests with the same engine flags, measured in the same run.

Machines are shared and noisy: compare the ratios of one run, not absolute figures
across runs.
"""

from __future__ import annotations

import functools
import gc
import math
import os
from dataclasses import dataclass

from pagedllm.bench.serve.cli import LAUNCHABLE
from pagedllm.bench.serve.client import run_serve_benchmark
from pagedllm.bench.serve.results import ServeResult
from pagedllm.bench.server_process import running_command, serve_command
from pagedllm.bench.tables import markdown_table
from pagedllm.bench.throughput import BenchRequest, BenchResult


@dataclass(frozen=True)
class LlamaServer:
    """How to start llama.cpp's server: the binary, its GGUF weights and its thread count."""

    binary: str
    gguf: str
    threads: int

    def command(self, port: int, num_requests: int, context_tokens: int) -> list[str]:
        # One slot per request (all may be in flight at once), each with room for its longest request.
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(self.threads),
                "-tb", str(self.threads), "-np", str(num_requests), "-c", str(context_tokens), "-b", "2048",
                "-ub", "512", "--no-warmup"]


@dataclass(frozen=True)
class ComparedRun:
    """One server's run on the requests (``served``), or the offline one (``offline``)."""

    name: str
    served: ServeResult | None = None
    offline: BenchResult | None = None

    @property
    def total_tokens_per_s(self) -> float:
        if self.offline is not None:
            return self.offline.total_tokens_per_s
        return (self.served.total_prompt_tokens + self.served.total_output_tokens) / self.served.duration_s


def check_launch(names: list[str], llama: LlamaServer) -> None:
    """``ValueError`` saying what to change for an unknown server name or a missing llama.cpp build."""
    unknown = [name for name in names if name not in LAUNCHABLE]
    if unknown:
        raise ValueError(f"--launch: unknown server {unknown[0]!r}; the servers are: {', '.join(LAUNCHABLE)}")
    if "llama-server" in names:
        if not os.access(llama.binary, os.X_OK):
            raise ValueError("--launch llama-server needs --llama-server PATH of a built llama-server "
                             "(scripts/llamacpp_compare.sh builds one into /tmp/llamacpp/bin)")
        if not os.path.isfile(llama.gguf):
            raise ValueError(f"--llama-gguf {llama.gguf!r} is not a file (scripts/llamacpp_compare.sh converts the "
                             "shipped GGUF to F32 / BF16 ones)")


def engine_options_of(engine_flags: list[str]) -> dict:
    """The ``LLM(...)`` options ``pagedllm serve ENGINE_FLAGS`` would build its engine with."""
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.engine_args import engine_options_from_args

    return engine_options_from_args(build_parser().parse_args(["serve", *engine_flags]))


def run_offline(engine_options: dict, requests: list[BenchRequest]) -> ComparedRun:
    """``LLM.generate`` on the requests (greedy, ``ignore_eos``, as the servers get them), after a
    warm-up; the engine is shut down and released before any server starts."""
    from pagedllm import LLM
    from pagedllm.bench.throughput import run_pagedllm

    llm = LLM(**engine_options)
    try:
        result = run_pagedllm(llm, requests, label="offline LLM.generate")
    finally:
        llm.shutdown()
    del llm
    gc.collect()
    return ComparedRun("offline LLM.generate", offline=result)


def run_launched(name: str, engine_flags: list[str], llama: LlamaServer, requests: list[BenchRequest],
                 request_rate: float, seed: int) -> ComparedRun:
    """Start one server, load it once untimed with one short request, then with the requests."""
    if name == "llama-server":
        context = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) * len(requests)
        command = functools.partial(llama.command, num_requests=len(requests), context_tokens=context)
    else:
        process_flag = "--engine-process" if name == "pagedllm" else "--no-engine-process"
        command = serve_command([process_flag, "--uvicorn-log-level", "warning", "--disable-log-stats",
                                 *engine_flags])
    with running_command(command) as (base_url, _pid):
        run_serve_benchmark(base_url, [BenchRequest([0] * 8, 4)], math.inf, seed=seed)  # warm-up
        return ComparedRun(LAUNCHABLE[name], served=run_serve_benchmark(base_url, requests, request_rate, seed=seed))


def format_comparison(runs: list[ComparedRun]) -> str:
    """One row per run: throughput (total = prompt + output tokens per second), the client's
    latency percentiles, the ratio to the offline run and the TTFT ratio to llama-server's."""
    offline = next((run for run in runs if run.offline is not None), None)
    llama = next((run for run in runs if run.name == "llama-server"), None)

    def ms(seconds: float) -> str:
        return "-" if math.isnan(seconds) else f"{1000 * seconds:.0f}"

    rows = []
    for run in runs:
        vs_offline = "-" if offline is None else f"{run.total_tokens_per_s / offline.total_tokens_per_s:.2f}x"
        if run.served is None:
            rows.append([run.name, run.offline.num_requests, 0, f"{run.total_tokens_per_s:.1f}",
                         f"{run.offline.output_tokens_per_s:.1f}", "-", "-", "-", "-", "-", "-", vs_offline, "-"])
            continue
        served = run.served
        ttft_vs_llama = "-" if llama is None else f"{served.ttft.p50 / llama.served.ttft.p50:.2f}x"
        rows.append([run.name, served.num_requests, served.num_failed, f"{run.total_tokens_per_s:.1f}",
                     f"{served.output_tokens_per_s:.1f}", ms(served.ttft.p50), ms(served.ttft.p90),
                     ms(served.ttft.p99), ms(served.tpot.p50), ms(served.tpot.p90), f"{served.e2e.p99:.2f}",
                     vs_offline, ttft_vs_llama])
    header = ["run", "requests", "failed", "total tok/s", "output tok/s", "TTFT p50 (ms)", "TTFT p90 (ms)",
              "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)", "e2e p99 (s)", "vs offline",
              "TTFT p50 vs llama-server"]
    return markdown_table(header, rows)

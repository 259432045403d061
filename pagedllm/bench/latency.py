"""`pagedllm bench latency`: one user at a time, and a few (issue 59).

Per configuration (streams x prompt length x new tokens), ``streams`` requests of random
prompts are submitted together (greedy, EOS ignored, so every stream makes exactly its
``output_len`` tokens) and the engine is stepped; each step's outputs say, per stream, when
each token became visible, as a user streaming it sees it:

  ms/token p50, p90: the intervals between a stream's consecutive tokens, over every stream
                     (tokens one step returns together, as speculation gives, are 0 apart);
  tok/s: the tokens of all streams after every stream has its first one, over that time
         (decode alone, as llama-batched-bench's ``S_TG t/s``);
  TTFT p50: from submission to a stream's first token;
  floor: the bytes one decode step must read, the weights as the engine holds them
         (``LLM.weight_bytes()``: packed GGUF blocks at their packed size) and every stream's
         KV at the step's context (on average over the decode: prompt + output / 2), at the
         bandwidth `pagedllm bench roofline` measures (``kernels.read_bandwidth_gbps``);
         "% of floor" is that time over the measured p50.

``--compare llama.cpp`` runs ``llama-batched-bench -npp P -ntg N -npl S`` (``moe_llama``) on
the same GGUF right after each configuration, so both see the same machine load. Before the
rows, the engine's first request (a 128-token prompt) gives the cold start's TTFT.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pagedllm import SamplingParams
from pagedllm.bench.moe import load_average
from pagedllm.bench.moe_llama import find_batched_bench, llama_decode_rate
from pagedllm.bench.tables import markdown_table
from pagedllm.bench.throughput import random_requests

if TYPE_CHECKING:
    from pagedllm import LLM
    from pagedllm.engine.llm_engine import LLMEngine

COLD_PROMPT_LEN = 128  # the short prompt: the engine's first request, its cold TTFT


@dataclass(frozen=True)
class LatencyConfig:
    streams: int
    prompt_len: int
    output_len: int


def latency_configs(streams: list[int], prompt_lens: list[int], output_lens: list[int]) -> list[LatencyConfig]:
    """Every combination, streams outermost (the order of the table's rows)."""
    if min(output_lens) < 2:
        raise ValueError(f"--output-len {min(output_lens)}: a stream needs 2 tokens or more to have an interval "
                         f"between tokens; pass --output-len 2 or more")
    return [LatencyConfig(*combination) for combination in itertools.product(streams, prompt_lens, output_lens)]


@dataclass
class StreamTimes:
    """When a set of streams was submitted, and when each of their tokens came out of a step
    (``time.perf_counter`` seconds)."""

    submitted: float
    arrivals: list[list[float]]  # per stream, one per token

    def ttfts_s(self) -> list[float]:
        return [stream[0] - self.submitted for stream in self.arrivals]

    def intervals_s(self) -> list[float]:
        return [later - earlier for stream in self.arrivals for earlier, later in zip(stream, stream[1:])]

    def decode_tokens_per_s(self) -> float:
        """Tokens of all streams after every stream has its first one, over that time."""
        everyone_started = max(stream[0] for stream in self.arrivals)
        later = [t for stream in self.arrivals for t in stream if t > everyone_started]
        if not later:
            return 0.0
        return len(later) / (max(later) - everyone_started)


def time_streams(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> StreamTimes:
    """Submit ``prompts`` together (greedy, EOS ignored) and step the engine until all are done."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    arrivals: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    submitted = time.perf_counter()
    for request_id, prompt in zip(arrivals, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            seen = arrivals[output.request_id]
            seen += [now] * (len(output.outputs[0].token_ids) - len(seen))
    return StreamTimes(submitted, list(arrivals.values()))


@dataclass
class LatencyRow:
    config: LatencyConfig
    ms_p50: float  # between a stream's tokens
    ms_p90: float
    tokens_per_s: float  # decode, all streams together
    ttft_ms_p50: float
    load: float  # 1-minute load average before the row's run
    llama_tokens_per_s: float | None = None

    @classmethod
    def of(cls, config: LatencyConfig, times: StreamTimes, load: float) -> LatencyRow:
        p50, p90 = np.percentile(times.intervals_s(), [50, 90])
        return cls(config, 1e3 * float(p50), 1e3 * float(p90), times.decode_tokens_per_s(),
                   1e3 * float(np.median(times.ttfts_s())), load)


@dataclass
class MemoryFloor:
    """What a decode step cannot avoid reading, and how fast this machine reads."""

    weight_bytes: int
    kv_bytes_per_token: int  # one token of one stream, every layer
    bandwidth_gbps: float

    def step_bytes(self, config: LatencyConfig) -> float:
        context = config.prompt_len + config.output_len / 2  # the mean over the decode steps
        return self.weight_bytes + config.streams * self.kv_bytes_per_token * context

    def ms_per_token(self, config: LatencyConfig) -> float:
        """A step gives every stream one token: the step's floor is each stream's."""
        return 1e3 * self.step_bytes(config) / (self.bandwidth_gbps * 1e9)


@dataclass
class LlamaSide:
    """llama-batched-bench for ``--compare llama.cpp``: the binary and GGUF, or why it cannot run."""

    binary: str | None
    gguf: Path | None
    threads: int
    failures: list[str] = field(default_factory=list)  # a run that failed: its configuration and error

    def why_not(self) -> str | None:
        if self.binary is None:
            return ("llama.cpp: no llama-batched-bench found (--llama-batched-bench PATH, else the PATH, else "
                    "/tmp/llamacpp/bin, where scripts/llamacpp_compare.sh builds one)")
        if self.gguf is None:
            return "llama.cpp: the model is not a GGUF file; --llama-gguf PATH gives llama.cpp one"
        return None

    def rate(self, config: LatencyConfig) -> float | None:
        """llama.cpp's decode tok/s; None where it cannot run or failed (noted: the other rows still count)."""
        if self.why_not() is not None:
            return None
        try:
            return llama_decode_rate(self.binary, self.gguf, config.streams, config.prompt_len, config.output_len,
                                     self.threads)
        except RuntimeError as exc:
            print(exc, flush=True)
            self.failures.append(f"llama.cpp failed on {config.streams} x ({config.prompt_len} + "
                                 f"{config.output_len}): {str(exc).splitlines()[0]}")
            return None


@dataclass
class LatencyResult:
    setup: str  # the model, its weights, dtype and threads
    rows: list[LatencyRow]
    floor: MemoryFloor
    built_s: float  # the engine's construction
    cold_ttft_s: float  # its first request's first token
    llama: LlamaSide | None = None
    notes: list[str] = field(default_factory=list)


def measure_rows(engine: LLMEngine, configs: list[LatencyConfig], seed: int, llama: LlamaSide | None) -> list[LatencyRow]:
    """Every configuration on ``engine``, each followed by llama.cpp's run of it (when compared)."""
    rows = []
    for index, config in enumerate(configs):
        prompts = [r.prompt_token_ids for r in random_requests(config.streams, config.prompt_len,
                                                               config.output_len, engine.vocab_size, seed + index)]
        row = LatencyRow.of(config, time_streams(engine, prompts, config.output_len, f"latency-{index}"),
                            load_average())
        if llama is not None:
            row.llama_tokens_per_s = llama.rate(config)
        print(f"{config.streams} x ({config.prompt_len} + {config.output_len}): {row.ms_p50:.2f} ms/token p50, "
              f"{row.tokens_per_s:.1f} tok/s" + (f", llama.cpp {row.llama_tokens_per_s:.1f} tok/s"
                                                 if row.llama_tokens_per_s else ""), flush=True)
        rows.append(row)
    return rows


def llama_side(args: argparse.Namespace, model: Path, threads: int) -> tuple[LlamaSide | None, list[str]]:
    """What ``--compare llama.cpp`` runs (None without it), and the notes the table needs about it."""
    if args.compare != "llama.cpp":
        return None, []
    gguf = Path(args.llama_gguf) if args.llama_gguf else model if model.suffix == ".gguf" else None
    side = LlamaSide(find_batched_bench(args.llama_batched_bench), gguf, threads)
    notes = [side.why_not()] if side.why_not() else []
    if gguf == model and args.gguf_weights == "dequantize":
        notes.append(f"llama.cpp read {model.name} as stored while pagedllm dequantized it to {args.dtype}: "
                     f"--llama-gguf with its F32 / BF16 conversion (scripts/llamacpp_compare.sh writes them) "
                     f"compares the same weights.")
    return side, notes


def measure_floor(llm: LLM) -> MemoryFloor:
    """The engine's weight and KV bytes, and this machine's read bandwidth as `bench roofline` measures it
    (in float32 whatever the model's dtype: the bandwidth is the machine's, and fp32 reads it fastest)."""
    import torch

    from pagedllm.bench.kernels import ModelMatmuls, read_bandwidth_gbps

    bandwidth = read_bandwidth_gbps(ModelMatmuls(llm.llm_engine.model_config, torch.float32))
    return MemoryFloor(llm.weight_bytes(), llm.stats()["bytes_per_token"], bandwidth)


def run(llm: LLM, args: argparse.Namespace, configs: list[LatencyConfig], built_s: float) -> LatencyResult:
    """The cold TTFT, every configuration (with llama.cpp's run of it where compared), then the floor."""
    import torch

    engine = llm.llm_engine
    cold = cold_ttft_s(engine, args.seed)
    model, threads = model_path(args.model), args.num_threads or torch.get_num_threads()
    llama, notes = llama_side(args, model, threads)
    rows = measure_rows(engine, configs, args.seed, llama)
    weights = f", {args.gguf_weights} GGUF weights" if model.suffix == ".gguf" else ""
    setup = f"{model.name}{weights}, {engine.config.dtype}, {threads} thread{'s' if threads > 1 else ''}"
    return LatencyResult(setup, rows, measure_floor(llm), built_s, cold, llama, notes)


def model_path(model: str | None) -> Path:
    """The model's file or folder (None: the embedded SmolLM2 GGUF)."""
    from pagedllm.model.loader import default_model_path

    return Path(model or default_model_path())


def cold_ttft_s(engine: LLMEngine, seed: int) -> float:
    """TTFT of the engine's first request, a ``COLD_PROMPT_LEN``-token prompt (it warms the engine up too)."""
    prompt = random_requests(1, COLD_PROMPT_LEN, 2, engine.vocab_size, seed - 1)[0].prompt_token_ids
    return time_streams(engine, [prompt], 2, "latency-cold").ttfts_s()[0]


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_table(result: LatencyResult) -> str:
    """One row per configuration, then the cold start and what kept llama.cpp out (if anything)."""
    header = ["streams", "prompt", "new tokens", "ms/token p50", "ms/token p90", "tok/s", "TTFT p50 (ms)",
              "floor ms/token", "% of floor"]
    if result.llama is not None:
        header += ["llama.cpp tok/s", "tok/s / llama.cpp"]
    table = []
    for row in result.rows:
        config, floor_ms = row.config, result.floor.ms_per_token(row.config)
        cells = [config.streams, config.prompt_len, config.output_len, f"{row.ms_p50:.2f}", f"{row.ms_p90:.2f}",
                 f"{row.tokens_per_s:.1f}", f"{row.ttft_ms_p50:.0f}", f"{floor_ms:.2f}",
                 f"{100 * floor_ms / row.ms_p50:.0f}%"]
        if result.llama is not None:
            llama = row.llama_tokens_per_s
            cells += [_figure(llama, ".1f"), "-" if not llama else f"{row.tokens_per_s / llama:.2f}x"]
        table.append([*cells, f"{row.load:.1f}"])
    notes = [f"Cold start: the engine built in {result.built_s:.1f} s; its first request, a {COLD_PROMPT_LEN}-token "
             f"prompt, had its first token {1e3 * result.cold_ttft_s:.0f} ms later.", *result.notes,
             *(result.llama.failures if result.llama is not None else [])]
    return markdown_table([*header, "load avg"], table) + "\n\n" + "\n".join(notes)


def describe(result: LatencyResult) -> str:
    """The record's setup line: the model, the workload and the floor's terms."""
    floor = result.floor
    llama = ""
    if result.llama is not None and result.llama.why_not() is None:
        llama = (f" llama.cpp: `{Path(result.llama.binary).name} -npp P -ntg N -npl S -t {result.llama.threads}` "
                 f"on {result.llama.gguf.name}, right after each row.")
    return (f"{result.setup}. Random prompts, all streams of a row submitted together, greedy, "
            f"EOS ignored; ms/token: intervals between a stream's tokens as the engine's steps return them; tok/s: "
            f"all streams' tokens after every stream has its first one, over that time. Floor: "
            f"{floor.weight_bytes / 1e6:.1f} MB of weights as held (`LLM.weight_bytes()`) + each stream's KV "
            f"({floor.kv_bytes_per_token} bytes/token) at prompt + new tokens / 2, read at "
            f"{floor.bandwidth_gbps:.1f} GB/s (`bench roofline`'s read of every weight once, after the rows).{llama}")

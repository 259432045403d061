"""`pagedllm bench roofline --dataset mixed`: a whole workload's steps against the
machine's roofline for them.

The machine's two ceilings are measured on weights of the model's shapes
(``ModelMatmuls``, each layer its own so they stream from memory): the matmul
rate of a 2,048-row pass through every projection, and the rate of reading
every weight once. Every engine step of the workload is then timed; its floor
is the larger of its linear layers' FLOPs at that rate (its tokens through every
projection, its sampled rows through the vocabulary one) and its weight bytes
at that bandwidth. Attention and sampling are left out, so the floor is below
what any engine can reach; engine time over floor time bounds the speed-up that
faster kernels can still bring to a phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedllm import SamplingParams
from pagedllm.bench.kernels import ModelMatmuls, best_time_s, read_bandwidth_gbps
from pagedllm.bench.tables import markdown_table
from pagedllm.bench.throughput import BenchRequest

ROOF_ROWS = 2048  # rows of the pass that measures the matmul ceiling (a full prefill step)


@dataclass
class Roof:
    gflops: float  # best matmul rate on the model's shapes
    read_gbps: float  # best rate of reading every weight once
    weight_bytes: int

    def floor_s(self, flops: float) -> float:
        return max(flops / (self.gflops * 1e9), self.weight_bytes / (self.read_gbps * 1e9))


@dataclass
class StepTiming:
    tokens: int  # through the forward
    sequences: int  # sampled (each one row of the vocabulary projection)
    engine_s: float
    flops: float  # of its linear layers

    @property
    def has_prompt(self) -> bool:
        return self.tokens > self.sequences


@torch.inference_mode()
def measure_roof(matmuls: ModelMatmuls, repeats: int = 3) -> Roof:
    pass_s = best_time_s(lambda: matmuls.run(ROOF_ROWS, ROOF_ROWS), repeats)
    return Roof(matmuls.flops(ROOF_ROWS, ROOF_ROWS) / pass_s / 1e9, read_bandwidth_gbps(matmuls, repeats),
                matmuls.weight_bytes)


@torch.inference_mode()
def time_steps(engine, requests: list[BenchRequest], matmuls: ModelMatmuls) -> list[StepTiming]:
    """Run ``requests`` (greedy, EOS ignored) one engine step at a time; the
    engine is left with no request."""
    for i, request in enumerate(requests):
        engine.add_request(f"phases-{i}", {"prompt_token_ids": request.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        tokens, sequences = engine.num_batched_tokens, engine.num_scheduled_sequences
        start = time.perf_counter()
        engine.step()
        engine_s = time.perf_counter() - start
        tokens, sequences = engine.num_batched_tokens - tokens, engine.num_scheduled_sequences - sequences
        steps.append(StepTiming(tokens, sequences, engine_s, matmuls.flops(tokens, sequences)))
    return steps


def format_phases(steps: list[StepTiming], roof: Roof) -> str:
    """One row per phase and one for the whole workload."""
    groups = [("steps with prompt tokens", [s for s in steps if s.has_prompt]),
              ("decode-only steps", [s for s in steps if not s.has_prompt]),
              ("whole workload", steps)]
    rows = []
    for name, group in groups:
        if not group:
            continue
        engine_s = sum(s.engine_s for s in group)
        floor_s = sum(roof.floor_s(s.flops) for s in group)
        tokens = sum(s.tokens for s in group)
        rows.append([name, len(group), tokens, f"{engine_s:.4g}", f"{tokens / engine_s:.0f}",
                     f"{sum(s.flops for s in group) / engine_s / 1e9:.0f}", f"{floor_s:.4g}",
                     f"{100 * floor_s / engine_s:.0f}%", f"{engine_s / floor_s:.2f}x"])
    return markdown_table(["phase", "steps", "tokens", "engine (s)", "engine tok/s", "engine linear GFLOP/s",
                           "roofline floor (s)", "floor / engine", "most speed-up left"], rows)

"""The request traces the fragmentation replay runs: ShareGPT-like lengths, a JSON
file of lengths, and Poisson arrivals over either."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedllm.bench.json_records import read_json_records

# The ShareGPT-like default trace: log-normal lengths whose means are ShareGPT's (161 prompt,
# 338 output tokens, as the PagedAttention paper reports them); the spreads give the long
# tails real chat traffic has.
SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA = 161.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 338.0, 0.9


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    arrival_step: int = 0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def sharegpt_like_trace(num_requests: int, max_model_len: int, seed: int = 0) -> list[TraceRequest]:
    """``num_requests`` lengths drawn like ShareGPT's, all arriving at step 0.

    Prompt and output lengths are log-normal with means ``SHAREGPT_PROMPT_MEAN`` /
    ``SHAREGPT_OUTPUT_MEAN`` and log-space spreads ``SHAREGPT_*_SIGMA`` (mu = ln(mean) -
    sigma^2 / 2), rounded, then clipped: the prompt to [1, max_model_len - 1] and the output
    to [1, max_model_len - prompt], so every request fits the model. ``random.Random(seed)``.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 for a prompt and an output, got {max_model_len}")
    rng = random.Random(seed)

    def draw(mean: float, sigma: float) -> int:
        return round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))

    trace = []
    for _ in range(num_requests):
        prompt = min(max(1, draw(SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA)), max_model_len - 1)
        output = min(max(1, draw(SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)), max_model_len - prompt)
        trace.append(TraceRequest(prompt, output))
    return trace


def load_trace(path: str) -> list[TraceRequest]:
    """A JSON list of ``{"prompt_len": P, "output_len": O}`` (P >= 1, O >= 0), arriving at step 0."""
    trace = read_json_records(
        path, "prompt_len, output_len",
        lambda item: TraceRequest(int(item["prompt_len"]), int(item["output_len"])),
    )
    bad = [i for i, r in enumerate(trace) if r.prompt_len < 1 or r.output_len < 0]
    if bad:
        raise ValueError(f"{path}: item {bad[0]} needs prompt_len >= 1 and output_len >= 0")
    return trace


def poisson_arrivals(trace: list[TraceRequest], arrival_rate: float, seed: int = 0) -> list[TraceRequest]:
    """The trace, in order, arriving as a Poisson process of ``arrival_rate`` requests per step;
    the first arrives at step 0."""
    rng = random.Random(f"{seed}:arrivals")
    arrivals, time = [], 0.0
    for request in trace:
        arrivals.append(TraceRequest(request.prompt_len, request.output_len, math.floor(time)))
        time += rng.expovariate(arrival_rate)
    return arrivals

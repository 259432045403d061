"""`pagedllm bench prefix`: a shared-system-prompt workload with prefix caching on and off."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from pagedllm import SamplingParams
from pagedllm.bench.throughput import token_range
from pagedllm.bench.tables import markdown_table


@dataclass
class PrefixResult:
    label: str
    prompt_tokens: int
    prefill_tokens_computed: int
    output_tokens: int
    elapsed_s: float
    ttft_s: list[float]
    peak_blocks: int

    @property
    def hit_rate(self) -> float:
        return 1 - self.prefill_tokens_computed / self.prompt_tokens

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def shared_prompt_workload(
    num_requests: int, system_len: int, question_len: tuple[int, int], vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """One system prompt shared by every request, then a unique question."""
    rng = random.Random(seed)
    low, high = token_range(vocab_size)
    system = [rng.randrange(low, high) for _ in range(system_len)]
    return [
        system + [rng.randrange(low, high) for _ in range(rng.randint(*question_len))] for _ in range(num_requests)
    ]


def run(llm, label: str, prompts: list[list[int]], output_len: int) -> PrefixResult:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.reset_peak_blocks_in_use()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return PrefixResult(
        label=label,
        prompt_tokens=prompt_tokens,
        prefill_tokens_computed=prompt_tokens - sum(o.num_cached_tokens for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed_s=elapsed,
        ttft_s=[o.metrics.first_token_time - o.metrics.arrival_time for o in outputs],
        peak_blocks=llm.stats()["peak_blocks_in_use"],
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def format_table(results: list[PrefixResult]) -> str:
    return markdown_table(
        ["prefix caching", "prefill tokens computed", "hit rate", "TTFT mean (s)", "TTFT p50 (s)", "TTFT p99 (s)",
         "total tok/s", "time (s)", "peak KV blocks"],
        [[r.label, f"{r.prefill_tokens_computed} of {r.prompt_tokens}", f"{100 * r.hit_rate:.1f}%",
          f"{statistics.mean(r.ttft_s):.2f}", f"{_percentile(r.ttft_s, 0.5):.2f}", f"{_percentile(r.ttft_s, 0.99):.2f}",
          f"{r.total_tokens_per_s:.1f}", f"{r.elapsed_s:.2f}", r.peak_blocks] for r in results])

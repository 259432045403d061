"""`pagedllm bench preemption`: recompute vs swap under a pool too small for the batch."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pagedllm import SamplingParams
from pagedllm.bench.throughput import random_requests
from pagedllm.bench.tables import markdown_table


@dataclass
class PreemptionResult:
    prompt_len: int
    mode: str
    num_blocks: int
    preemptions: int
    recomputed_tokens: int
    swapped_blocks: int
    elapsed_s: float


def pool_for(num_requests: int, prompt_len: int, output_len: int, block_size: int) -> int:
    """Two prompts plus one request's growth: two requests fit at admission but not at
    their full length, so decoding always runs out of blocks and someone is preempted."""
    per_request = math.ceil((prompt_len + output_len) / block_size)
    prompt_blocks = math.ceil(prompt_len / block_size)
    return max(per_request + 1, 2 * prompt_blocks + per_request - prompt_blocks - 1)


def run(make_llm, prompt_len: int, output_len: int, num_requests: int, mode: str, block_size: int) -> PreemptionResult:
    num_blocks = pool_for(num_requests, prompt_len, output_len, block_size)
    llm = make_llm(mode, num_blocks)
    requests = random_requests(num_requests, prompt_len, output_len, llm.llm_engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    return PreemptionResult(
        prompt_len, mode, num_blocks, stats["num_preemptions"], stats["num_recomputed_tokens"],
        stats["swap_out_blocks"], elapsed,
    )


def format_table(results: list[PreemptionResult]) -> str:
    baseline = {r.prompt_len: r.elapsed_s for r in results if r.mode == "recompute"}
    return markdown_table(
        ["prompt tokens", "mode", "pool blocks", "preemptions", "tokens recomputed", "blocks swapped out", "time (s)",
         "vs recompute"],
        [[r.prompt_len, r.mode, r.num_blocks, r.preemptions, r.recomputed_tokens, r.swapped_blocks,
          f"{r.elapsed_s:.2f}", f"{baseline[r.prompt_len] / r.elapsed_s:.2f}x"] for r in results])

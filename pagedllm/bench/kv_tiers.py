"""`pagedllm bench kv-tiers`: multi-turn conversations whose reused prefixes
outgrow the pool, with and without the tiers below it; and a restart.

Conversations take turns round-robin (every conversation's turn t, then turn
t+1), each turn's prompt being the conversation so far (its history, the
previous answer, a new user message). Their histories together are several
times the pool, so by the time a conversation speaks again the pool has
evicted its prefix: without tiers it is recomputed, with them it is loaded.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm import LLM, SamplingParams
from pagedllm.bench.tables import markdown_table
from pagedllm.bench.throughput import token_range


@dataclass
class TierRun:
    label: str
    prompt_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft_s)


def conversations(num: int, system_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Each conversation's opening: its own system prompt and first message."""
    rng = random.Random(seed)
    low, high = token_range(vocab_size)
    return [[rng.randrange(low, high) for _ in range(system_len)] for _ in range(num)]


def run_turns(llm: LLM, label: str, openings: list[list[int]], turns: int, turn_len: int, output_len: int,
              concurrency: int, seed: int = 0) -> TierRun:
    """All turns, round-robin; every conversation's turn is one request, ``concurrency``
    conversations' requests submitted together (users who speak at about the same time)."""
    rng = random.Random(seed + 1)
    low, high = token_range(llm.llm_engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    histories = [list(opening) for opening in openings]
    result = TierRun(label)
    started = time.perf_counter()
    groups = [histories[i:i + concurrency] for i in range(0, len(histories), concurrency)] * turns
    for group in groups:  # every group's turn, then every group's next turn
        for history in group:
            history += [rng.randrange(low, high) for _ in range(turn_len)]
        outputs = llm.generate([{"prompt_token_ids": list(h)} for h in group], params, use_tqdm=False)
        for history, output in zip(group, outputs):
            tokens = list(output.outputs[0].token_ids)
            result.prompt_tokens += len(output.prompt_token_ids)
            result.hit_tokens += output.num_cached_tokens
            result.output_tokens += len(tokens)
            result.ttft_s.append(output.metrics.first_token_time - output.metrics.arrival_time)
            result.outputs.append(tokens)
            history += tokens
    result.elapsed_s = time.perf_counter() - started
    result.stats = llm.stats()
    return result


def format_turns(runs: list[TierRun], pool_tokens: int, reused_tokens: int) -> str:
    base = runs[0]
    rows = []
    for run in runs:
        stats = run.stats
        rows.append([
            run.label, f"{run.hit_tokens} of {run.prompt_tokens}",
            f"{run.hit_tokens / base.hit_tokens:.2f}x" if base.hit_tokens else ("-" if run is base else "all new"),
            f"{run.ttft_p50:.3f}", f"{run.ttft_p50 / base.ttft_p50:.2f}x",
            f"{(run.prompt_tokens + run.output_tokens) / run.elapsed_s:.0f}", f"{run.elapsed_s:.1f}",
            f"{stats.get('host_tier_hits', 0)} / {stats.get('disk_tier_hits', 0)}",
            "yes" if run.outputs == base.outputs else "NO",
        ])
    table = markdown_table(
        ["tiers", "prefix-hit tokens", "hits vs none", "TTFT p50 (s)", "vs none", "total tok/s", "time (s)",
         "tier hits host / disk (blocks)", "outputs = none's"], rows)
    return f"{table}\n\nReused prefixes: {reused_tokens} tokens, {reused_tokens / pool_tokens:.1f}x the pool " \
           f"({pool_tokens} tokens)."


@dataclass
class RestartRow:
    label: str
    ttft_s: float
    hit_tokens: int
    outputs: list[int]


def run_restart(make: Callable[[bool], LLM], prompt_len: int, output_len: int) -> list[RestartRow]:
    """TTFT of one long prompt: recomputed (no tiers), then from disk after a
    restart (one engine writes it, a new engine on the same folder reads it)."""
    recompute = make(False)
    rng = random.Random(7)
    low, high = token_range(recompute.llm_engine.vocab_size)
    prompt = {"prompt_token_ids": [rng.randrange(low, high) for _ in range(prompt_len)]}
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def once(llm: LLM, label: str) -> RestartRow:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        return RestartRow(label, output.metrics.first_token_time - output.metrics.arrival_time,
                          output.num_cached_tokens, list(output.outputs[0].token_ids))

    rows = [once(recompute, "recompute (no tiers)")]
    writer = make(True)
    rows.append(once(writer, "first run, writing the disk tier"))
    writer.shutdown()  # its queued writes are finished: the "crash" comes after them
    rows.append(once(make(True), "after a restart, from disk"))
    return rows


def format_restart(rows: list[RestartRow]) -> str:
    base = rows[0]
    return markdown_table(
        ["run", "TTFT (s)", "vs recompute", "prefix-hit tokens", "outputs = recompute's"],
        [[row.label, f"{row.ttft_s:.3f}", f"{row.ttft_s / base.ttft_s:.2f}x", row.hit_tokens,
          "yes" if row.outputs == base.outputs else "NO"] for row in rows])

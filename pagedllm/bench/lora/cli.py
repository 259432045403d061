"""`pagedllm bench lora`: the flags, the runs in order, the table and the goals.

Runs, each on a fresh engine with the command's engine flags: the base model with a
pool of K blocks (``--num-kv-blocks``, else enough for every request at once, so the
base run is never starved); then per ``--num-adapters`` N a LoRA engine with K + 8 x
(blocks per adapter) blocks, the memory a fixed-slot design spends on its 8 adapter
slots on top of the same KV pool, and no cap on resident adapters (``max_loras``
None); then the base again, so drift over the run shows (the base figure is the two
runs' mean). After the first LoRA run, the page-in cost alone is measured on that idle
engine. This module imports nothing heavy: every `pagedllm` command builds its parser.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from pagedllm.bench.arg_types import positive_int, positive_int_list

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (adapters, least throughput vs base) the issue asks for.
GOALS = ((8, 0.8), (256, 0.6))
PROBE_ADAPTERS = 3  # page-ins timed alone; the median is reported


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's own flags (the engine flags and --record come with ``add_bench_command``)."""
    parser.add_argument("--num-adapters", type=positive_int_list, default=[1, 8, 64, 256], metavar="N,N,...",
                        help="one LoRA run per count; requests round-robin over the adapters (default: 1,8,64,256)")
    parser.add_argument("--rank", type=positive_int, default=16, help="rank of every adapter")
    parser.add_argument("--targets", type=lambda text: tuple(t.strip() for t in text.split(",") if t.strip()),
                        default=ALL_TARGETS, metavar="MODULE,...",
                        help="projections every adapter targets (default: all seven)")
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--fixed-slots", type=positive_int, default=8,
                        help="adapter slots of the fixed-slot design whose memory the LoRA runs get on top of the "
                             "base pool (vLLM's max_loras)")
    parser.add_argument("--adapter-dir", default=os.path.join(tempfile.gettempdir(), "pagedllm-bench-lora"),
                        help="where the random PEFT adapters are written, and reused by later runs "
                             "(default: %(default)s)")


@dataclass
class LoRABench:
    """What ``measure`` found: the runs in order, the page-in probe and the pools."""

    runs: list[Any]  # runs.LoRARun
    page_in: Any  # runs.PageInCost, or None without a LoRA run
    base_blocks: int
    pages_per_adapter: int
    prompt_tokens: tuple[int, int, int]  # least, most, total


def measure(args: argparse.Namespace) -> LoRABench:
    """Build the requests and adapters, then time every run in order (see the module docstring)."""
    from pagedllm.bench.lora import runs
    from pagedllm.bench.lora.adapters import write_adapters
    from pagedllm.entrypoints.engine_args import make_llm
    from pagedllm.model.loader import load_tokenizer

    requests = runs.real_text_requests(load_tokenizer(args.model), args.num_prompts, args.max_tokens, args.seed)
    base_blocks = args.num_kv_blocks or runs.blocks_for(requests, args.block_size)
    base = make_llm(args, enable_lora=False, num_kv_blocks=base_blocks)
    pages = runs.pages_per_adapter(base, args.rank, args.targets)
    used = max(min(n, len(requests)) for n in args.num_adapters)
    paths = write_adapters(args.adapter_dir, base.llm_engine.model_config, max(used, PROBE_ADAPTERS), args.rank,
                           args.targets)
    _log(f"{len(requests)} requests, base pool {base_blocks} blocks, {pages} blocks per adapter, adapters in "
         f"{os.path.dirname(paths[0])}")
    done = [_finish(base, runs.timed_run(base, "base (first)", requests, None))]
    page_in = None
    for count in args.num_adapters:
        llm = make_llm(args, enable_lora=True, max_lora_rank=args.rank, max_loras=None,
                       num_kv_blocks=base_blocks + args.fixed_slots * pages)
        loras = runs.lora_requests(paths, count, len(requests))
        registered = llm.llm_engine.adapter_registry.spec_for(loras[0]).num_pages
        if registered != pages:
            raise RuntimeError(f"the engine pages an adapter into {registered} blocks, the bench planned {pages}")
        run = runs.timed_run(llm, f"{count} adapter{'s' * (count != 1)}", requests, loras, paths[0], count)
        if page_in is None:
            page_in = runs.page_in_cost(llm, paths[:PROBE_ADAPTERS], len(requests) + 2)
        done.append(_finish(llm, run))
    base = make_llm(args, enable_lora=False, num_kv_blocks=base_blocks)
    done.append(_finish(base, runs.timed_run(base, "base (last)", requests, None)))
    lengths = [len(r.prompt_token_ids) for r in requests]
    return LoRABench(done, page_in, base_blocks, pages, (min(lengths), max(lengths), sum(lengths)))


def _finish(llm: Any, run: Any) -> Any:
    """Log one run's figure as it completes (the table comes only at the end) and free its engine."""
    from pagedllm.bench.throughput import format_step_split

    _log(f"{run.label}: {run.result.total_tokens_per_s:.1f} total tok/s, {run.page_ins} page-ins, peak "
         f"{run.peak_running} running; step split: {format_step_split(run.step_timings)}")
    llm.shutdown()
    return run


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def base_figure(bench: LoRABench) -> tuple[float, float]:
    """The base runs' mean total tok/s and their spread (largest minus smallest, over the mean)."""
    rates = [r.result.total_tokens_per_s for r in bench.runs if r.num_adapters is None]
    mean = statistics.fmean(rates)
    return mean, (max(rates) - min(rates)) / mean


def format_table(bench: LoRABench) -> str:
    """One row per run, in the order they ran."""
    from pagedllm.bench.tables import markdown_table

    base, _ = base_figure(bench)
    rows = []
    for run in bench.runs:
        page_in = run.mean_page_in_ms
        rows.append([run.label, "-" if run.num_adapters is None else run.num_adapters,
                     "-" if run.num_adapters is None else run.adapters_used, run.num_blocks,
                     f"{run.result.total_tokens_per_s:.1f}", f"{run.result.total_tokens_per_s / base:.2f}x",
                     run.page_ins, "-" if page_in is None else f"{page_in:.1f}", run.peak_running,
                     f"{run.result.mean_batch:.1f}"])
    return markdown_table(["run", "adapters", "adapters used", "pool blocks", "total tok/s", "vs base", "page-ins",
                           "mean page-in ms", "peak running / step", "mean running / step"], rows)


def summary(bench: LoRABench) -> str:
    """The base figure, each goal met or missed, and the page-in cost alone."""
    base, spread = base_figure(bench)
    lines = [f"- Base: {base:.1f} total tok/s, mean of the first and last runs (which differ by {100 * spread:.1f}%)."]
    for count, goal in GOALS:
        run = next((r for r in bench.runs if r.num_adapters == count), None)
        if run is not None:
            ratio = run.result.total_tokens_per_s / base
            verdict = "met" if ratio >= goal else f"missed by {goal - ratio:.2f}"
            lines.append(f"- {count} adapters: **{ratio:.2f}x** base (goal >= {goal}x): {verdict}.")
    cost = bench.page_in
    if cost is not None:
        lines.append(f"- Page-in alone (idle engine, median of {PROBE_ADAPTERS}): {cost.load_ms:.1f} ms, of which "
                     f"{cost.read_ms:.1f} ms reading the {cost.file_mb:.1f} MB bf16 file into fp32 tensors; the "
                     f"adapter takes {cost.num_pages} blocks ({cost.pool_mib:.1f} MiB of pool).")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> str:
    """Run the bench, print the table and the goals (``--record``: append them), return the table."""
    from pagedllm.bench.record import cpu_description, report

    load_before = os.getloadavg()[0]
    bench = measure(args)
    load_after = os.getloadavg()[0]
    low, high, total = bench.prompt_tokens
    setup = (f"CPU: {cpu_description()}. {args.num_prompts} real-text prompts of {low}-{high} tokens ({total} in "
             f"all), {args.max_tokens} output tokens each (greedy, ignore_eos), all submitted at once, request i "
             f"under adapter i mod N; rank-{args.rank} adapters on {','.join(args.targets)}. Base pool "
             f"{bench.base_blocks} blocks (every request at once); LoRA pools {bench.base_blocks} + "
             f"{args.fixed_slots} x {bench.pages_per_adapter} blocks (the adapter memory of {args.fixed_slots} fixed "
             f"slots on top), max_loras None. Each run on a fresh engine; adapters registered (read and checked "
             f"once per name) before the clock starts, page-ins timed in it. 1-minute load average "
             f"{load_before:.1f} at the start, {load_after:.1f} at the end (other processes on the machine slow "
             f"the LoRA path's many small multi-threaded operations most).")
    table = format_table(bench)
    report(args, f"{table}\n\n{summary(bench)}", setup)
    return table

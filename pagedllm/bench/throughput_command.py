"""`pagedllm bench throughput`: this engine against a baseline on the same
requests (Hugging Face ``generate``, or this engine with one option changed),
timed through the public ``LLM`` API."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm import LLM
from pagedllm.bench.plotting import require_matplotlib
from pagedllm.bench.record import report
from pagedllm.config.engine import torch_dtype
from pagedllm.entrypoints.engine_args import make_llm

if TYPE_CHECKING:
    import torch

    from pagedllm.bench.throughput import BenchRequest, BenchResult

BASELINES = ("none", "hf", "contiguous", "kv-auto", "tp1", "sync", "fp32")


@dataclass
class _MeasuredRun:
    """The timed pagedllm run of `bench throughput`, kept after its engine is gone."""

    result: BenchResult
    stats: dict
    capacity: str
    step_split: str
    device: torch.device
    traffic: str | None  # the all-reduce payload, with more than one rank


def _check_baseline(args: argparse.Namespace) -> None:
    """Refuse a baseline that would compare the engine with itself, before loading anything."""
    if args.baseline == "tp1" and args.tensor_parallel_size == 1:
        raise ValueError("--baseline tp1 compares tensor parallelism with one rank: pass --tensor-parallel-size")
    if args.baseline == "kv-auto" and args.kv_cache_dtype == "auto":
        raise ValueError("--baseline kv-auto compares a quantized pool with the auto one: pass --kv-cache-dtype")
    if args.baseline == "fp32" and args.dtype in ("auto", "float32"):
        raise ValueError("--baseline fp32 compares a lower-precision dtype with fp32: pass --dtype bfloat16 "
                         "(or float16)")
    if args.baseline == "sync" and not args.async_scheduling:
        raise ValueError("--baseline sync compares overlapped steps with synchronous ones: pass --async-scheduling")


def _throughput_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    from pagedllm.bench import throughput as bench

    if args.dataset == "random":
        return bench.random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed)
    if args.dataset == "mixed":
        return bench.mixed_requests(args.num_prompts, vocab_size, args.seed)
    return bench.load_requests(args.dataset)


def _pagedllm_label(args: argparse.Namespace) -> str:
    if args.async_scheduling:
        return "pagedllm (async scheduling)"
    if args.tensor_parallel_size > 1:
        return f"pagedllm ({args.tensor_parallel_size} ranks)"
    if args.baseline == "fp32":
        return f"pagedllm ({args.dtype})"
    storage = args.kv_layout if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    return f"pagedllm ({storage} KV)"


def _measure_pagedllm(args: argparse.Namespace, llm: LLM, requests: list[BenchRequest]) -> _MeasuredRun:
    from pagedllm.bench import throughput as bench

    engine = llm.llm_engine
    capacity = engine.capacity_line()
    print(capacity)
    result = bench.run_pagedllm(llm, requests, _pagedllm_label(args))
    stats = llm.stats()
    if args.plot:
        from pagedllm.bench.pool_plot import peak_pool_snapshot, write_pool_plot

        llm.reset_prefix_cache()  # replay from the measured run's starting point
        print(f"pool at its fullest: {write_pool_plot(peak_pool_snapshot(llm, requests), args.plot)}")
    traffic = None
    if args.tensor_parallel_size > 1:
        traffic = bench.tensor_parallel_traffic(engine.model_config, torch_dtype(engine.config.dtype).itemsize,
                                                args.tensor_parallel_size, stats["num_batched_tokens"],
                                                stats["num_steps"])
    return _MeasuredRun(result, stats, capacity, bench.format_step_split(llm.step_timings()), engine.device, traffic)


def _run_baseline(args: argparse.Namespace, requests: list[BenchRequest],
                  device: torch.device) -> tuple[list[BenchResult], list[tuple[str, dict]]]:
    """The baseline's results, and its pool stats when the pools are what is compared."""
    from pagedllm.bench import throughput as bench

    if args.baseline == "tp1":
        return [bench.run_pagedllm(make_llm(args, tensor_parallel_size=1), requests, "pagedllm (1 rank)")], []
    if args.baseline == "sync":
        return [bench.run_pagedllm(make_llm(args, async_scheduling=False), requests, "pagedllm (synchronous steps)")], []
    if args.baseline == "fp32":
        return [bench.run_pagedllm(make_llm(args, dtype="float32"), requests, "pagedllm (float32)")], []
    if args.baseline == "contiguous":
        return [bench.run_pagedllm(make_llm(args, kv_layout="contiguous"), requests, "pagedllm (contiguous KV)")], []
    if args.baseline == "kv-auto":
        auto = make_llm(args, kv_cache_dtype="auto")
        result = bench.run_pagedllm(auto, requests, f"pagedllm (auto KV, {args.dtype})")
        return [result], [(result.engine, auto.stats())]
    if args.baseline == "hf":
        import torch

        from pagedllm.bench.hf_reference import load_hf_model

        if device.type == "cuda":  # give Hugging Face the memory this engine's pool held
            torch.cuda.empty_cache()
        hf_model = load_hf_model(args.model, torch_dtype(args.dtype)).to(device)
        results = [bench.run_hf(hf_model, requests, batch_size) for batch_size in args.hf_batch_size]
        if bench.hf_has_continuous_batching():
            results.append(bench.run_hf_continuous(hf_model, requests))
        return results, []
    return [], []


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from pagedllm.bench import throughput as bench

    _check_baseline(args)
    if args.plot:
        require_matplotlib()  # before loading anything, not after the run
    llm = make_llm(args)
    args.dtype = llm.llm_engine.config.dtype  # "auto" resolved: the baselines and labels use the same dtype
    requests = _throughput_requests(args, llm.llm_engine.vocab_size)
    measured = _measure_pagedllm(args, llm, requests)
    llm.shutdown()
    del llm  # one model copy at a time: the baseline loads its own
    baseline_results, baseline_pools = _run_baseline(args, requests, measured.device)
    results = [measured.result, *baseline_results]
    sections = [bench.format_table(results), bench.format_ratios(results)]
    if baseline_pools:
        sections.append(bench.format_pool_table([(measured.result.engine, measured.stats), *baseline_pools]))
    if measured.traffic:
        sections.append(measured.traffic)
    table = "\n\n".join(section for section in sections if section)  # no ratios without an HF baseline
    stats = measured.stats
    report(args, table, f"{measured.capacity}, {args.kv_layout} layout. Peak blocks in use "
                        f"{stats['peak_blocks_in_use']}, preemptions {stats['num_preemptions']}, mean running "
                        f"sequences per step {stats['mean_running_per_step']:.1f}. Step time: {measured.step_split}.",
           measured.device)
    print(
        f"peak KV blocks in use: {stats['peak_blocks_in_use']} of {stats['num_blocks']}; preemptions: "
        f"{stats['num_preemptions']}; mean running sequences per step: {stats['mean_running_per_step']:.1f}"
    )
    print(f"pagedllm step time: {measured.step_split}")

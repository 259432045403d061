"""`pagedllm bench ...`: the benchmark subcommands and their flags.

Every bench that builds an engine takes all the engine flags (``engine_args``)
and ``--record FILE``, which appends its result table to FILE (e.g.
BENCHMARKS.md) with the command line that made it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import torch_dtype
from pagedllm.bench.record import report
from pagedllm.entrypoints.bench_decode import add_decode_benches
from pagedllm.entrypoints.engine_args import add_engine_args, engine_flags_from_args, make_llm
from pagedllm.entrypoints.llm import LLM

if TYPE_CHECKING:
    import torch

    from pagedllm.bench.throughput import BenchRequest, BenchResult

_BASELINES = ("none", "hf", "contiguous", "kv-auto", "tp1", "sync", "fp32")


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


def cmd_bench_sharing(args: argparse.Namespace) -> None:
    from pagedllm.bench import sharing

    rows = sharing.measure(lambda enable: make_llm(args, enable_block_sharing=enable),
                           args.prompt_len, args.output_len, args.n, args.beam_width)
    report(args, sharing.format_table(rows, args.block_size),
           f"Prompt {args.prompt_len} tokens, {args.output_len} generated per sequence, block size {args.block_size}.")


def cmd_bench_prefix(args: argparse.Namespace) -> None:
    from pagedllm.bench import prefix

    results = []
    for enabled in (True, False):
        llm = make_llm(args, enable_prefix_caching=enabled)
        prompts = prefix.shared_prompt_workload(
            args.num_prompts, args.system_len, (args.question_min, args.question_max), llm.llm_engine.vocab_size
        )
        results.append(prefix.run(llm, "on" if enabled else "off", prompts, args.output_len))
    report(args, prefix.format_table(results),
           f"{args.num_prompts} requests: a shared {args.system_len}-token system prompt + a unique "
           f"{args.question_min}-{args.question_max}-token question, {args.output_len} output tokens, "
           f"all submitted at once.")


def cmd_bench_preemption(args: argparse.Namespace) -> None:
    from pagedllm.bench import preemption

    def make(mode: str, num_blocks: int) -> LLM:
        return make_llm(args, preemption_mode=mode, num_kv_blocks=num_blocks, enable_prefix_caching=False)

    results = [
        preemption.run(make, prompt_len, args.output_len, args.num_prompts, mode, args.block_size)
        for prompt_len in args.prompt_len
        for mode in ("recompute", "swap")
    ]
    report(args, preemption.format_table(results),
           f"{args.num_prompts} requests of random tokens, {args.output_len} output tokens each, submitted at "
           f"once; prefix caching off; the pool holds two prompts but not two whole requests.")


def cmd_bench_attention(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels

    if args.prefill:
        report(args, kernels.format_prefill_attention(kernels.prefill_attention_rows(args.prefill)),
               "Causal prefill attention of one layer, SmolLM2 shapes (9 query heads, 3 KV heads, head dim 64), "
               "best of 5 calls.")
        return
    report(args, kernels.format_attention(kernels.attention_rows(args.batch, args.context)),
           "SmolLM2 attention shapes (9 query heads, 3 KV heads, head dim 64), fp32, block size 16, best of 5 calls.")


def cmd_bench_linear(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels
    from pagedllm.model.loader import load_checkpoint

    config = load_checkpoint(args.model).config
    report(args, kernels.format_linear(kernels.linear_rows(config, args.batch, dtype=torch_dtype(args.dtype))),
           f"Every {args.dtype} projection of one decode step of {args.model or 'SmolLM2-135M-Instruct (embedded)'} "
           f"(own weights per layer, LM head included), best of 8 interleaved passes.")


def cmd_bench_quant(args: argparse.Namespace) -> None:
    from pathlib import Path

    from pagedllm.bench import quant

    shape = dict(quant.QWEN25_05B, layers=args.layers or quant.QWEN25_05B["layers"])
    results = quant.run(Path(args.workdir), shape, args.batch_size, args.prompt_len, args.output_len)
    report(args, quant.format_table(results),
           f"CPU: {quant.cpu_description()}. Random Qwen2.5-0.5B-shaped model ({shape}) as GGUF; fp32/bf16 are the "
           f"Q8_0 file dequantized at load. {args.batch_size} sequences, {args.prompt_len}-token prompts, "
           f"{args.output_len} output tokens (ignore_eos), each run in its own process.")


def cmd_bench_roofline(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels
    from pagedllm.bench.throughput import random_requests

    llm = make_llm(args, enable_prefix_caching=False)  # every sequence prefills its own prompt
    engine = llm.llm_engine
    args.dtype = engine.config.dtype  # "auto" resolved, for the table's label
    prompts = [r.prompt_token_ids
               for r in random_requests(args.batch_size, args.prompt_len, 1, engine.vocab_size, args.seed)]
    result = kernels.roofline_vs_decode(engine, args.batch_size, prompts, args.decode_tokens,
                                        torch_dtype(args.dtype))
    table = (
        "| dtype | rows | matmul GFLOP/s (model shapes) | roofline decode tok/s | decode tok/s, best step "
        "| decode tok/s, median step | of roofline (best, median) |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {args.dtype} | {args.batch_size} | {result.gflops:.1f} | {result.bound_tokens_per_s:.0f} | "
        f"{result.best_decode_tokens_per_s:.0f} | {result.median_decode_tokens_per_s:.0f} | "
        f"{100 * result.best_decode_tokens_per_s / result.bound_tokens_per_s:.0f}%, "
        f"{100 * result.median_decode_tokens_per_s / result.bound_tokens_per_s:.0f}% |"
    )
    report(args, table, f"Batch of {args.batch_size} sequences, {args.prompt_len}-token prompts; "
                        f"{args.decode_tokens} matmul passes and {args.decode_tokens} decode steps, interleaved.")


def cmd_bench_soak(args: argparse.Namespace) -> None:
    from pagedllm.bench import soak

    server_args = engine_flags_from_args(args)  # the server gets every engine flag given here
    result = soak.run_soak(args.duration, args.concurrency, args.abort_fraction, args.seed, server_args)
    report(args, soak.format_table(result), f"Server: `pagedllm serve {' '.join(server_args)}`; "
                                            f"{args.concurrency} clients, {args.abort_fraction:.0%} of streams "
                                            f"cut off mid-way.")
    for sample in result.error_samples:
        print(f"error: {sample}")
    if result.errors or result.blocks_in_use_after_drain != 0:
        raise SystemExit("soak failed: errors or KV blocks still in use after the drain")


def _add_bench(benches: argparse._SubParsersAction, name: str, help_text: str,
               command: Callable[[argparse.Namespace], object], *, builds_engine: bool = True) -> argparse.ArgumentParser:
    """A `pagedllm bench NAME` parser with the engine flags (when it builds an engine) and --record."""
    parser = benches.add_parser(name, help=help_text)
    if builds_engine:
        add_engine_args(parser)
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="append the result table to FILE (e.g. BENCHMARKS.md)")
    parser.set_defaults(func=command)
    return parser


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from pagedllm.bench import fragmentation, serve

    benches = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_throughput_parser(benches)
    _add_kv_pool_benches(benches)
    _add_kernel_benches(benches)
    add_decode_benches(benches, _add_bench)
    sk = _add_bench(benches, "soak", "a long randomized load with aborts against a server it starts (with these "
                                     "engine flags); fails on any error or a KV block still in use after the drain",
                    cmd_bench_soak)
    sk.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    sk.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    sk.add_argument("--abort-fraction", type=float, default=0.3, help="share of streams cut off mid-way")
    for module, name, help_text in (
        (serve, "serve", "load generator against a running OpenAI-compatible server"),
        (fragmentation, "fragmentation", "KV waste of paged vs contiguous layouts on a request trace "
                                         "(bookkeeping only, no model)"),
    ):
        parser = benches.add_parser(name, help=help_text)
        module.build_arg_parser(parser)  # its own flags, --record among them
        parser.set_defaults(func=module.main)


def _add_throughput_parser(benches: argparse._SubParsersAction) -> None:
    tp = _add_bench(benches, "throughput", "offline throughput vs a baseline on the same requests",
                    cmd_bench_throughput)
    tp.add_argument("--dataset", default="random",
                    help="'random' (--input-len/--output-len), 'mixed' (log-uniform 16-512 prompt, 16-256 output) "
                         "or a JSON file of {prompt_token_ids, max_tokens}")
    tp.add_argument("--num-prompts", type=int, default=32)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=64)
    tp.add_argument("--baseline", choices=_BASELINES, default="none",
                    help="hf: transformers generate; contiguous: this engine with one max_model_len reservation per "
                         "request; kv-auto: this engine with an unquantized pool of the same memory "
                         "(with --kv-cache-dtype int8 or fp8_e4m3); tp1: this engine on one rank "
                         "(with --tensor-parallel-size N); sync: this engine without --async-scheduling; fp32: this engine "
                         "in float32 (with --dtype bfloat16 or float16)")
    tp.add_argument("--plot", default=None, metavar="DIR",
                    help="also replay the workload (untimed) and write DIR/kv_pool.png: the pool at its fullest")
    tp.add_argument("--hf-batch-size", type=int, nargs="+", default=[8],
                    help="static batch sizes for the HF baseline; the best one is the baseline")


def _add_kv_pool_benches(benches: argparse._SubParsersAction) -> None:
    sh = _add_bench(benches, "sharing", "KV blocks saved by block sharing (parallel sampling, beam search)",
                    cmd_bench_sharing)
    sh.add_argument("--prompt-len", type=int, default=2000)
    sh.add_argument("--output-len", type=int, default=32)
    sh.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    sh.add_argument("--beam-width", type=int, nargs="+", default=[2, 4, 8])
    px = _add_bench(benches, "prefix", "shared-system-prompt workload, prefix caching on vs off", cmd_bench_prefix)
    px.add_argument("--num-prompts", type=int, default=64)
    px.add_argument("--system-len", type=int, default=512)
    px.add_argument("--question-min", type=int, default=32)
    px.add_argument("--question-max", type=int, default=128)
    px.add_argument("--output-len", type=int, default=64)
    pe = _add_bench(benches, "preemption", "recompute vs swap under a pool that forces preemption",
                    cmd_bench_preemption)
    pe.add_argument("--prompt-len", type=int, nargs="+", default=[64, 1500])
    pe.add_argument("--output-len", type=int, default=64)
    pe.add_argument("--num-prompts", type=int, default=12)


def _add_kernel_benches(benches: argparse._SubParsersAction) -> None:
    at = _add_bench(benches, "attention", "paged decode attention vs contiguous SDPA (or, with --prefill, bf16 prefill attention)",
                    cmd_bench_attention,
                    builds_engine=False)
    at.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    at.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024, 4096])
    at.add_argument("--prefill", type=int, nargs="+", default=None, metavar="LEN",
                    help="instead: causal prefill attention at these prompt lengths, the C++ bf16 kernel vs SDPA")
    li = _add_bench(benches, "linear", "decode matmuls: the C++ small-batch and packed kernels vs PyTorch (MKL / oneDNN)",
                    cmd_bench_linear, builds_engine=False)
    li.add_argument("--model", default=None, help="model whose shapes to use (default: the embedded SmolLM2)")
    li.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64])
    li.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    qu = _add_bench(benches, "quant", "decode speed and memory: packed Q8_0/Q4_0 GGUF weights vs fp32/bf16",
                    cmd_bench_quant, builds_engine=False)
    qu.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check (default: 24)")
    qu.add_argument("--batch-size", type=int, default=4)
    qu.add_argument("--prompt-len", type=int, default=16)
    qu.add_argument("--output-len", type=int, default=32)
    qu.add_argument("--workdir", default="/tmp/pagedllm-bench-quant",
                    help="where the random GGUF files are written (and reused by later runs)")
    rf = _add_bench(benches, "roofline", "matmul roofline on the model's shapes vs measured decode",
                    cmd_bench_roofline)
    rf.add_argument("--batch-size", type=int, default=64)
    rf.add_argument("--prompt-len", type=int, default=32)
    rf.add_argument("--decode-tokens", type=int, default=32)

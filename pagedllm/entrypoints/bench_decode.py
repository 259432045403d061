"""`pagedllm bench structured` and `pagedllm bench spec`: decode-time features
(guided rows, speculative decoding) against the same engine without them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pagedllm.bench.record import report
from pagedllm.entrypoints.engine_args import make_llm


def cmd_bench_structured(args: argparse.Namespace) -> None:
    from pagedllm.bench import structured

    # Two engines stepping in turn; prefix caching off so every round prefills its own prompts.
    llms = tuple(make_llm(args, enable_prefix_caching=False) for _ in range(2))
    free, guided = structured.measure(llms, args.num_prompts, args.input_len, args.output_len,
                                      args.num_guided, args.rounds, args.seed)
    report(args, structured.format_table(free, guided, args.num_prompts),
           f"{args.num_prompts} random {args.input_len}-token prompts, {args.output_len} greedy tokens each, on two "
           f"engines stepping in turn: all rows free, and {args.num_guided} rows guided by a JSON schema (a list of "
           f"at least {args.output_len} records); decode steps of {args.rounds} rounds (each engine runs each batch).",
           llms[0].llm_engine.device)


def cmd_bench_spec(args: argparse.Namespace) -> None:
    from pagedllm.bench import speculative

    config = args.speculative_config or {"method": "ngram", "num_speculative_tokens": 4}
    llms = (make_llm(args, speculative_config=None), make_llm(args, speculative_config=config))
    results = speculative.measure(llms, args.output_len, args.num_mixed, args.rounds, args.seed)
    report(args, speculative.format_table(results),
           f"Speculative decoding {config} vs the same engine without it, greedy (identical tokens checked), "
           f"{args.output_len}-token cap on the repetitive prompts, {args.rounds} round(s), the engines alternating.",
           llms[0].llm_engine.device)


def add_decode_benches(benches: argparse._SubParsersAction, add_bench: Callable[..., argparse.ArgumentParser]) -> None:
    """Register both benches; ``add_bench`` gives a parser the engine flags and --record."""
    so = add_bench(benches, "structured", "decode throughput of a batch with guided (JSON schema) rows vs all free",
                    cmd_bench_structured)
    so.add_argument("--num-prompts", type=int, default=32)
    so.add_argument("--num-guided", type=int, default=4, help="rows of the batch under a JSON schema")
    so.add_argument("--input-len", type=int, default=64)
    so.add_argument("--output-len", type=int, default=64)
    so.add_argument("--rounds", type=int, default=4,
                    help="runs of both batches, swapping engines and stepping order (decode steps are summed)")
    sp = add_bench(benches, "spec", "speculative decoding (n-gram prompt lookup) vs none: single-request decode on "
                                     "repetitive real text, and a mixed batch", cmd_bench_spec)
    sp.add_argument("--output-len", type=int, default=256, help="most tokens per repetitive-workload answer")
    sp.add_argument("--num-mixed", type=int, default=16, help="requests of the mixed batch")
    sp.add_argument("--rounds", type=int, default=1, help="times each workload runs on each engine")

"""`pagedllm bench structured` and `pagedllm bench spec`: decode-time features
(guided rows, speculative decoding) against the same engine without them; and
`pagedllm bench differential`: features against their oracles on real text."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pagedllm.bench.record import report
from pagedllm.entrypoints.engine_args import engine_options_from_args, make_llm


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


def cmd_bench_differential(args: argparse.Namespace) -> None:
    from pagedllm.differential.cases import CaseOptions, build_cases, check_case_names
    from pagedllm.differential.compare import format_reports
    from pagedllm.differential.harness import run_case
    from pagedllm.differential.prompts import real_text_prompts

    names = args.cases.split(",")
    check_case_names(names)
    # Every engine flag reaches every case's engines (a case's own option wins on its side;
    # CaseOptions' own model and pool size win over the flags').
    options = CaseOptions(args.model, args.max_tokens, args.num_kv_blocks or 512, engine_options_from_args(args))
    prompts = real_text_prompts(args.num_prompts, seed=args.prompt_seed)
    reports = []
    for name in names:  # one name's engines at a time, so a long run holds only those in memory
        for case in build_cases([name], options):
            if args.only is None or args.only in case.name:
                reports.append(run_case(case, prompts))
                _print_progress(case, reports[-1])
    report(args, format_reports(reports),
           f"Differential cases {names} on {args.num_prompts} real-text prompts (Python's reference docs, seed "
           f"{args.prompt_seed}), up to {args.max_tokens} new tokens each.")


def _print_progress(case, report_of_case) -> None:
    """A long run's progress: each divergence, then the case's row, as it completes."""
    from pagedllm.differential.compare import describe_divergence

    decode = case.engines[0].get_tokenizer().decode if case.engines else str
    for comparison in report_of_case.divergences():
        print(f"[{case.name}] {describe_divergence(comparison, decode)}", flush=True)
    print(" | ".join(report_of_case.summary_row()), flush=True)


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
    di = add_bench(benches, "differential", "features against their oracles (HF generate, the engine without the "
                                            "feature) on real-text prompts: identical sequences, score errors",
                   cmd_bench_differential)
    di.add_argument("--cases", default="greedy-hf,speculative,beam",
                    help="comma-separated registered cases (pagedllm.differential.cases.CASES)")
    di.add_argument("--only", default=None, metavar="TEXT", help="run only the cases whose name contains TEXT "
                                                                 "(e.g. 'W=4 ' for beam width 4)")
    di.add_argument("--num-prompts", type=int, default=50)
    di.add_argument("--max-tokens", type=int, default=32, help="most new tokens per prompt")
    di.add_argument("--prompt-seed", type=int, default=0, help="which real-text passages")

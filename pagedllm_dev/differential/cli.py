"""The differential harness's command line, run from a source checkout's root:

    python -m pagedllm_dev.differential --cases beam --num-prompts 50 --max-tokens 16 --record BENCHMARKS.md

``pagedllm bench differential`` with the same flags hands over to this (where
``pagedllm_dev`` can be imported). Every engine flag of ``pagedllm`` reaches
every engine a case builds; a case's own option wins on its side.
"""

from __future__ import annotations

import argparse

from pagedllm.bench.record import report
from pagedllm.entrypoints.cli import run_command
from pagedllm.entrypoints.engine_args import add_engine_args, engine_options_from_args
from pagedllm_dev.differential.cases import CASES, CaseOptions, build_cases, check_case_names
from pagedllm_dev.differential.compare import DifferentialReport, describe_divergence, format_reports
from pagedllm_dev.differential.harness import DifferentialCase, run_case
from pagedllm_dev.differential.prompts import real_text_prompts

PROGRAM = "python -m pagedllm_dev.differential"


def build_parser(prog: str = PROGRAM) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Features against their oracles (HF generate, the engine without the feature) on "
                               "real-text prompts: identical sequences, score errors.")
    add_engine_args(parser)
    parser.add_argument("--cases", default="greedy-hf,speculative,beam",
                        help=f"comma-separated registered cases: {', '.join(CASES)}")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="run only the cases whose name contains TEXT (e.g. 'W=4 ' for beam width 4)")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32, help="most new tokens per prompt")
    parser.add_argument("--prompt-seed", type=int, default=0, help="which real-text passages")
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="append the result table to FILE (e.g. BENCHMARKS.md)")
    parser.set_defaults(func=run_differential)
    return parser


def run_differential(args: argparse.Namespace) -> None:
    """Run every case of ``--cases`` (those matching ``--only``), printing each
    divergence and each case's row as it completes, then the table."""
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


def _print_progress(case: DifferentialCase, case_report: DifferentialReport) -> None:
    """A long run's progress: each divergence, then the case's row, as it completes."""
    decode = case.engines[0].get_tokenizer().decode if case.engines else str
    for comparison in case_report.divergences():
        print(f"[{case.name}] {describe_divergence(comparison, decode)}", flush=True)
    print(" | ".join(case_report.summary_row()), flush=True)


def main(argv: list[str] | None = None, prog: str = PROGRAM) -> None:
    """Run the harness on ``argv`` (``sys.argv[1:]`` when None); ``prog`` is how
    the command was spelled (for --help and the --record header)."""
    run_command(build_parser(prog), argv, prog)

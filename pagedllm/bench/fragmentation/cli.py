"""`pagedllm bench fragmentation`'s flags and ``main``."""

from __future__ import annotations

import argparse
import json

from pagedllm.bench.arg_types import positive_finite_rate, positive_int
from pagedllm.bench.fragmentation.plots import write_plots
from pagedllm.bench.fragmentation.pool import RESERVATIONS, PoolSpec
from pagedllm.bench.fragmentation.report import describe, format_tables, run_fragmentation
from pagedllm.bench.fragmentation.traces import load_trace, poisson_arrivals, sharegpt_like_trace
from pagedllm.bench.plotting import require_matplotlib
from pagedllm.bench.record import append_result


def build_arg_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset", default=None, metavar="PATH", help='JSON list of {"prompt_len", "output_len"} (default: ShareGPT-like trace)'
    )
    parser.add_argument("--num-requests", type=positive_int, default=1000, help="requests in the default trace")
    parser.add_argument("--num-blocks", type=positive_int, default=2048, help="KV pool size in blocks")
    parser.add_argument("--block-size", type=_block_size, default=16, help="tokens per block (power of two)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048, help="longest request; the 'max' reservation")
    parser.add_argument(
        "--reservation",
        choices=RESERVATIONS,
        default="max",
        help="contiguous reservation: max_model_len (max), next power of two of the final length (pow2) or the final length (oracle)",
    )
    parser.add_argument(
        "--arrival-rate", type=positive_finite_rate, default=None, help="Poisson arrivals, requests per step (default: all at step 0)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the default trace and the arrivals")
    parser.add_argument("--json", action="store_true", help="print only a JSON object")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write the three PNG plots into DIR")
    parser.add_argument("--record", default=None, metavar="FILE", help="append the result tables to FILE")


def main(args: argparse.Namespace) -> None:
    """Replay the trace through both layouts, print the tables (or only JSON with ``--json``),
    write the plots with ``--plot`` and append the tables to ``--record``."""
    if args.plot:
        require_matplotlib()  # before the replay, not after it
    if args.dataset:
        trace, trace_name = load_trace(args.dataset), args.dataset
    else:
        trace = sharegpt_like_trace(args.num_requests, args.max_model_len, args.seed)
        trace_name = f"ShareGPT-like log-normal lengths, seed {args.seed}"
    if args.arrival_rate is not None:
        trace = poisson_arrivals(trace, args.arrival_rate, args.seed)
        trace_name += f", Poisson arrivals at {args.arrival_rate:g} per step"
    else:
        trace_name += ", all arriving at step 0"
    spec = PoolSpec(args.num_blocks, args.block_size, args.max_model_len, args.reservation)
    report = run_fragmentation(trace, spec)
    tables = format_tables(report)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(describe(report, trace_name))
        print()
        print(tables)
    if args.plot:
        write_plots(report, args.plot)
    if args.record:
        append_result(args.record, getattr(args, "argv", None), describe(report, trace_name), tables)


def _block_size(text: str) -> int:
    value = positive_int(text)
    if value > 256 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two in [1, 256], got {value}")
    return value

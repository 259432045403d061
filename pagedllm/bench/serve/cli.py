"""`pagedllm bench serve`'s flags and ``main``: one run per request rate, on the same requests.

The HTTP client (``client``, ``stream``: httpx) is imported when a run starts: every `pagedllm`
command builds this parser, and a first ``generate`` should not pay ~0.15 s for httpx.
"""

from __future__ import annotations

import argparse
import sys

from pagedllm.bench.arg_types import positive_int, positive_rate
from pagedllm.bench.record import append_result
from pagedllm.bench.serve.results import ServeResult, format_rate, format_table
from pagedllm.bench.throughput import BenchRequest, load_requests, random_requests


def build_arg_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``pagedllm bench serve`` flags to ``parser``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--dataset",
        default="random",
        help="'random', or a JSON file of {prompt_token_ids, max_tokens} (all of it is sent; "
        "--num-prompts, --input-len and --output-len apply to random only)",
    )
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument(
        "--request-rate",
        type=positive_rate,
        nargs="+",
        default=[float("inf")],
        help="requests/s of the Poisson arrivals, one run per value ('inf': all at once; default inf)",
    )
    parser.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        default=49152,
        help="token ids of random prompts are drawn below this (the bench does not load the model; default SmolLM2's)",
    )
    parser.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE")


def _requests_from_args(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The requests to send and a sentence describing them."""
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.seed)
        return requests, (
            f"{args.num_prompts} random-token prompts of {args.input_len} tokens, {args.output_len} output tokens each"
        )
    requests = load_requests(args.dataset)
    return requests, f"{len(requests)} requests from {args.dataset}"


def _print_failures(result: ServeResult) -> None:
    if result.num_failed:
        print(
            f"{result.num_failed} of {result.num_requests} requests failed at rate {format_rate(result.request_rate)}; "
            f"first errors:",
            file=sys.stderr,
        )
        for error in result.errors:
            print(f"  {error}", file=sys.stderr)


def main(args: argparse.Namespace) -> str:
    """Run one benchmark per ``--request-rate`` on the same requests, print the table (failures go
    to stderr), append it to ``--record`` when given, and return it."""
    from pagedllm.bench.serve.client import run_serve_benchmark  # loads httpx (see the module docstring)

    requests, description = _requests_from_args(args)
    model = args.model
    results = []
    for rate in args.request_rate:
        result = run_serve_benchmark(
            args.base_url, requests, rate, model, args.api_key, args.seed, args.max_concurrency
        )
        # The model the first run found is reused, so every run names the same one.
        model = result.model
        _print_failures(result)
        results.append(result)
    table = format_table(results)
    print(table)
    if args.record:
        concurrency = args.max_concurrency or "unlimited"
        append_result(
            args.record,
            getattr(args, "argv", None),
            f"Server {args.base_url}, model {model}. {description}; Poisson arrivals (seed {args.seed}), "
            f"max concurrency {concurrency}. Percentiles are nearest-rank over completed requests.",
            table,
        )
    return table

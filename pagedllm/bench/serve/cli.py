"""`pagedllm bench serve`'s flags and ``main``: one run per request rate, on the same requests.

The HTTP client (``client``, ``stream``: httpx) is imported when a run starts: every `pagedllm`
command builds this parser, and a first ``generate`` should not pay ~0.15 s for httpx.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from pagedllm.bench.arg_types import positive_int, positive_rate
from pagedllm.bench.record import append_result, cpu_description
from pagedllm.bench.serve.results import ServeResult, format_rate, format_table
from pagedllm.bench.throughput import BenchRequest, load_requests, mixed_requests, random_requests

# Where scripts/llamacpp_compare.sh builds llama.cpp and converts the shipped GGUF.
DEFAULT_LLAMA_SERVER = "/tmp/llamacpp/bin/llama-server"
DEFAULT_LLAMA_GGUF = "/tmp/llamacpp/smollm2-F32.gguf"
# What --launch accepts -> the run's name in the table (the server it starts).
LAUNCHABLE = {
    "pagedllm": "pagedllm serve",  # the engine core in its own process
    "pagedllm-thread": "pagedllm serve --no-engine-process",  # the engine loop in a thread of the API server
    "llama-server": "llama-server",  # llama.cpp's, from --llama-server with --llama-gguf
}


def build_arg_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``pagedllm bench serve`` flags to ``parser``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--dataset",
        default="random",
        help="'random', 'mixed' (the throughput bench's mixed workload of --num-prompts requests), or a JSON "
        "file of {prompt_token_ids, max_tokens} (all of it is sent; --num-prompts applies to random and mixed, "
        "--input-len and --output-len to random only)",
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
    launch = parser.add_argument_group(
        "servers the bench starts itself (instead of --base-url), one after the other, for a comparison in one run")
    launch.add_argument("--launch", nargs="+", default=None, metavar="SERVER",
                        help=f"start and load each of: {', '.join(LAUNCHABLE)} (pagedllm-thread: --no-engine-process)")
    launch.add_argument("--offline", action="store_true",
                        help="also time LLM.generate on the same requests with the same engine flags (first)")
    launch.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, metavar="PATH",
                        help="llama.cpp's llama-server binary (default: %(default)s, where "
                             "scripts/llamacpp_compare.sh builds it)")
    launch.add_argument("--llama-gguf", default=DEFAULT_LLAMA_GGUF, metavar="FILE",
                        help="the GGUF llama-server loads (default: %(default)s; give the same weights as the "
                             "pagedllm servers, e.g. the BF16 file with --dtype bfloat16)")
    launch.add_argument("--llama-threads", type=positive_int, default=os.cpu_count() or 1,
                        help="llama-server's -t and -tb (default: every CPU, as pagedllm's default)")
    launch.add_argument("--serve-args", default="", metavar="FLAGS",
                        help="engine flags for the pagedllm servers and the offline run, as one string "
                             "(e.g. \"--dtype bfloat16 --gguf-weights dequantize\")")


def _requests_from_args(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The requests to send and a sentence describing them."""
    if args.dataset == "mixed":
        requests = mixed_requests(args.num_prompts, args.vocab_size, args.seed)
        return requests, (
            f"the mixed workload: {args.num_prompts} requests (seed {args.seed}), "
            f"{sum(len(r.prompt_token_ids) for r in requests)} prompt + {sum(r.max_tokens for r in requests)} output "
            "tokens, prompt and output lengths log-uniform over 16-512 and 16-256"
        )
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
    to stderr), append it to ``--record`` when given, and return it. With ``--launch``: the
    comparison of the servers it starts (``compare``)."""
    requests, description = _requests_from_args(args)
    if args.launch is not None or args.offline:
        return _compare(args, requests, description)
    if args.serve_args:
        raise ValueError("--serve-args applies to the servers --launch starts; against --base-url it would be "
                         "ignored: drop it or add --launch")
    from pagedllm.bench.serve.client import run_serve_benchmark  # loads httpx (see the module docstring)

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


def _compare(args: argparse.Namespace, requests: list[BenchRequest], description: str) -> str:
    from pagedllm.bench.serve import compare  # loads httpx (see the module docstring)

    if len(args.request_rate) != 1:
        raise ValueError("--launch compares the servers at one --request-rate; give one value")
    names = args.launch or []
    llama = compare.LlamaServer(args.llama_server, args.llama_gguf, args.llama_threads)
    compare.check_launch(names, llama)
    engine_flags = shlex.split(args.serve_args)
    runs = [compare.run_offline(compare.engine_options_of(engine_flags), requests)] if args.offline else []
    for name in names:
        runs.append(compare.run_launched(name, engine_flags, llama, requests, args.request_rate[0], args.seed))
        _print_failures(runs[-1].served)
    table = compare.format_comparison(runs)
    print(table)
    if args.record:
        llama_note = (f" llama-server: {os.path.basename(args.llama_gguf)}, -t/-tb {args.llama_threads}, one slot per "
                      "request." if "llama-server" in names else "")
        append_result(
            args.record, getattr(args, "argv", None),
            f"Machine: {cpu_description()}. Requests: {description}; rate {format_rate(args.request_rate[0])}, greedy, "
            f"ignore_eos, streamed by one client; engine flags: {' '.join(engine_flags) or 'the defaults'}."
            f"{llama_note} Each server got one short untimed request first; the offline run a warm-up.",
            table,
        )
    return table

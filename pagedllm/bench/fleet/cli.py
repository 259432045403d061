"""`pagedllm bench fleet`: prefix-aware routing vs round-robin vs one engine, on the same
multi-turn chat workload.

Each run starts a server on a free port, loads it once untimed, sends the workload
(``workload``, ``client``) and stops it: ``serve --data-parallel-size N --router prefix``
and ``--router round-robin`` (optionally ``least-load``) with ``--num-kv-blocks B`` per
replica, and one engine, ``serve --num-kv-blocks N*B``, holding every replica's pool
on all the cores. The workload's reused prefixes (the system prompts and the open
conversations) are sized to overflow one replica's pool but fit the fleet's, so the
policy decides how much of them stays cached. The HTTP client (httpx) is imported
when a run starts, as in `bench serve`.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

from pagedllm.bench.arg_types import positive_int, positive_rate
from pagedllm.bench.record import append_result, cpu_description

RUNS = ("prefix", "round-robin", "least-load", "single")
DEFAULT_RUNS = ("prefix", "round-robin", "single")
# Per-replica pool, when not given: this share of the workload's working set (so one pool
# cannot hold it and the fleet's can, with room for the requests' own growth).
AUTO_POOL_SHARE = 0.7


def build_arg_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``pagedllm bench fleet`` flags to ``parser``."""
    parser.add_argument("--model", default=None, help="checkpoint the servers load (default: the embedded SmolLM2)")
    parser.add_argument("--data-parallel-size", type=positive_int, default=2, help="replicas of the fleet runs")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV blocks of each replica's pool; the one engine gets N times as many (default: "
                             f"{AUTO_POOL_SHARE:g} of the workload's working set, printed at the start)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(DEFAULT_RUNS),
                        help="in this order; single: one engine with every replica's blocks (default: %(default)s)")
    parser.add_argument("--num-system-prompts", type=positive_int, default=8)
    parser.add_argument("--system-tokens", type=positive_int, default=512, help="least tokens of a system prompt")
    parser.add_argument("--num-conversations", type=positive_int, default=32)
    parser.add_argument("--turns", type=positive_int, default=4, help="requests per conversation")
    parser.add_argument("--live-conversations", type=positive_int, default=12,
                        help="conversations open at a time (a closed one is replaced by the next)")
    parser.add_argument("--user-tokens", type=positive_int, default=48, help="least tokens of a user message")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens of every reply (ignore_eos)")
    parser.add_argument("--request-rate", type=positive_rate, default=4.0,
                        help="requests/s (a turn waits for its conversation's previous reply; default %(default)s)")
    parser.add_argument("--arrivals", choices=("fixed", "poisson"), default="fixed")
    parser.add_argument("--seed", type=int, default=0, help="seeds the text, the turn order and Poisson arrivals")
    parser.add_argument("--serve-args", default="", metavar="FLAGS",
                        help="more engine flags for every server, as one string (e.g. \"--dtype bfloat16\")")
    parser.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE")


def spec_of(args: argparse.Namespace):
    from pagedllm.bench.fleet.workload import WorkloadSpec

    return WorkloadSpec(num_system_prompts=args.num_system_prompts, system_tokens=args.system_tokens,
                        num_conversations=args.num_conversations, turns=args.turns,
                        live_conversations=args.live_conversations, user_tokens=args.user_tokens,
                        max_tokens=args.max_tokens, request_rate=args.request_rate, arrivals=args.arrivals,
                        seed=args.seed)


def server_flags(run: str, replicas: int, blocks: int, args: argparse.Namespace) -> list[str]:
    """The ``pagedllm serve`` flags of one run (the port aside)."""
    flags = ["--uvicorn-log-level", "warning", "--disable-log-stats", "--block-size", str(args.block_size)]
    if args.model:
        flags += ["--model", args.model]
    if run == "single":
        flags += ["--num-kv-blocks", str(replicas * blocks)]
    else:
        flags += ["--data-parallel-size", str(replicas), "--router", run, "--num-kv-blocks", str(blocks)]
    return flags + shlex.split(args.serve_args)


def run_label(run: str, replicas: int, blocks: int) -> str:
    if run == "single":
        return f"one engine, {replicas * blocks} blocks"
    return f"{replicas} replicas x {blocks} blocks, {run}"


def describe(workload, blocks: int, replicas: int, block_size: int) -> str:
    """A sentence describing the workload and the pools."""
    spec = workload.spec
    tokens = workload.system_prompt_tokens
    rate = f"{spec.request_rate:g} req/s ({spec.arrivals} arrivals, seed {spec.seed})"
    return (f"{spec.num_system_prompts} system prompts of {min(tokens)}-{max(tokens)} tokens; "
            f"{spec.num_conversations} conversations x {spec.turns} turns ({workload.num_requests} streamed chat "
            f"requests), {spec.live_conversations} open at a time, user messages >= {spec.user_tokens} tokens, "
            f"{spec.max_tokens} output tokens per reply (greedy, ignore_eos), each turn carrying the previous "
            f"replies; {rate}. Working set of reused prefixes ~{workload.working_set_blocks(block_size)} blocks "
            f"of {block_size}; pools: {blocks} blocks per replica, {replicas * blocks} for the one engine")


def main(args: argparse.Namespace) -> str:
    """Run every ``--runs`` server in turn on the same workload, print the table and the goals,
    append them to ``--record`` when given, and return the table."""
    from pagedllm.bench.fleet.report import fleet_table, goals_text
    from pagedllm.bench.fleet.workload import build_workload, tokenizer_counter
    from pagedllm.model.loader import load_tokenizer

    workload = build_workload(spec_of(args), tokenizer_counter(load_tokenizer(args.model)))
    replicas = args.data_parallel_size
    blocks = args.num_kv_blocks or math.ceil(AUTO_POOL_SHARE * workload.working_set_blocks(args.block_size))
    description = describe(workload, blocks, replicas, args.block_size)
    print(f"Workload: {description}.", file=sys.stderr, flush=True)
    results = []
    for run in args.runs:
        result = run_server(run, replicas, blocks, args, workload)
        print(f"{result.label}: {result.summary_line()}", file=sys.stderr, flush=True)
        results.append(result)
    table, goals = fleet_table(results), goals_text(results)
    print(table)
    print(goals)
    if args.record:
        append_result(args.record, getattr(args, "argv", None),
                      f"Machine: {cpu_description()}. Workload: {description}. Each server was started in turn on "
                      f"a free port and got one short untimed chat per replica first; extra engine flags: "
                      f"{args.serve_args or 'none'}. Percentiles are nearest-rank over completed requests; TTFT "
                      f"is timed from each request's send.", f"{table}\n\n{goals}", getattr(args, "program", "pagedllm"))
    return table


def run_server(run: str, replicas: int, blocks: int, args: argparse.Namespace, workload):
    """Start one run's server, wait for all its replicas, warm it up, send the workload, stop it."""
    from pagedllm.bench.fleet.client import run_workload, warm_up
    from pagedllm.bench.fleet.report import FleetResult, wait_for_replicas
    from pagedllm.bench.server_process import running_server

    with running_server(server_flags(run, replicas, blocks, args)) as (base_url, _pid):
        fleet = run != "single"
        if fleet:
            wait_for_replicas(base_url, replicas)
        warm_up(base_url, replicas if fleet else 1)
        done = run_workload(base_url, workload)
    return FleetResult(run, run_label(run, replicas, blocks), done.metrics, done.duration_s)

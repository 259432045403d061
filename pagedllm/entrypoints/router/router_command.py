"""``pagedllm router --replica URL ...``: the router in front of separately started
``pagedllm serve`` processes; also the front of ``serve --data-parallel-size N``."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.serve_setup import add_shutdown_timeout_option
from pagedllm.fleet.routing import POLICIES, BalanceRule


def add_routing_options(parser: argparse.ArgumentParser) -> None:
    """The routing flags, shared by ``pagedllm router`` and ``serve --data-parallel-size``."""
    defaults = BalanceRule()
    parser.add_argument("--router", default="prefix", choices=POLICIES,
                        help="prefix: the replica holding the longest cached prefix of the prompt (from its KV "
                             "events), unless it is overloaded; round-robin; least-load (default: %(default)s)")
    parser.add_argument("--balance-abs-threshold", type=float, default=defaults.balance_abs_threshold,
                        help="the best-hit replica is overloaded when it has this many requests in flight more than "
                             "the least-loaded one ... (default: %(default)s)")
    parser.add_argument("--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
                        help="... and this many times as many (default: %(default)s)")
    parser.add_argument("--claim-ttl", type=float, default=30.0,
                        help="seconds a routed prompt counts as cached on its replica before the replica's own "
                             "events confirm it (default: %(default)s)")
    parser.add_argument("--health-interval", type=float, default=0.5,
                        help="seconds between /health polls of each replica; two failed polls mark it down "
                             "(default: %(default)s)")


def add_router_parser(commands: argparse._SubParsersAction) -> None:
    router = commands.add_parser("router", help="prefix-aware router in front of pagedllm serve replicas")
    router.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each; start each with "
                             "--kv-events-config so the router sees its cache)")
    router.add_argument("--model", default=None,
                        help="the replicas' model, whose tokenizer the router hashes prompts with "
                             "(default: the embedded SmolLM2)")
    router.add_argument("--chat-template", default=None, help="the replicas' --chat-template, if they use one")
    router.add_argument("--api-keys-file", default=None,
                        help="the replicas' {api_key: tenant} file, so tenants' prompts hash with their salt")
    router.add_argument("--host", default="0.0.0.0")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    router.add_argument("--timeout-keep-alive", type=int, default=5)
    add_shutdown_timeout_option(router)
    add_routing_options(router)
    router.set_defaults(func=cmd_router)


def router_state(args: argparse.Namespace, urls: list[str]):
    """The router's shared state from its flags (the tokenizer is read here)."""
    from pagedllm.entrypoints.chat_utils import load_chat_template
    from pagedllm.entrypoints.serve_setup import read_tenants_file
    from pagedllm.fleet.prefix_index import PrefixIndex
    from pagedllm.entrypoints.router.replica import Replica
    from pagedllm.entrypoints.router.request_prefix import prompt_fingerprint
    from pagedllm.entrypoints.router.router_app import RouterState
    from pagedllm.fleet.routing import RoutingPolicy
    from pagedllm.model.loader import load_tokenizer

    if args.health_interval <= 0:
        raise ValueError(f"--health-interval must be > 0, got {args.health_interval}")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--replica {url!r}: give the replica's base URL, e.g. http://127.0.0.1:8000")
    tokenizer = load_tokenizer(args.model)
    template = load_chat_template(args.chat_template)
    balance = BalanceRule(args.balance_abs_threshold, args.balance_rel_threshold)
    return RouterState(
        replicas=[Replica(i, url) for i, url in enumerate(urls)], policy=RoutingPolicy(args.router, balance),
        tokenizer=tokenizer, fingerprint=prompt_fingerprint(tokenizer, template), chat_template=template,
        api_keys=read_tenants_file(args.api_keys_file) if args.api_keys_file else {}, health_interval_s=args.health_interval,
        index=PrefixIndex(claim_ttl_s=args.claim_ttl))


def serve_router(args: argparse.Namespace, state, stop_router, drain) -> None:
    """Serve the router over ``state`` on ``args.host``/``args.port`` until SIGTERM (after
    ``drain``), SIGINT or ``stop_router()``."""
    from pagedllm.entrypoints.router.router_app import build_router_app
    from pagedllm.entrypoints.serve_setup import run_uvicorn

    options = dict(host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                   timeout_keep_alive=args.timeout_keep_alive)
    run_uvicorn(build_router_app(state), options, stop_router, drain)


def cmd_router(args: argparse.Namespace) -> None:
    """The router alone: on SIGTERM it drains its proxied requests for ``--shutdown-timeout``
    (the replicas are not its own: what is still open then is cut, and each replica aborts it)."""
    from pagedllm.entrypoints.draining import Drain
    from pagedllm.entrypoints.serve_setup import ServerStopper

    serve_router(args, router_state(args, args.replica), ServerStopper(), Drain(args.shutdown_timeout))

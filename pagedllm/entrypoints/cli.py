"""The serving commands of `pagedllm`: run, generate, serve, explain and worker.

The engine flags are generated from the config dataclasses (``engine_args``).
The `pagedllm` command itself (``pagedllm.cli``) adds the benchmarks
(``pagedllm.bench.cli``) to these; ``python -m pagedllm.entrypoints.cli``
runs these alone (the worker ranks and the bench server are started so).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, get_args

from pagedllm.config.engine import CacheConfig, DType, EngineConfig
from pagedllm.entrypoints.engine_args import add_engine_args, engine_options_from_args, make_llm
from pagedllm.entrypoints.openai.common.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.responses.store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES
from pagedllm.entrypoints.serve_setup import add_shutdown_timeout_option
from pagedllm.logger import init_logger
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

logger = init_logger(__name__)

# Adds more top-level commands to the parser's subcommands (``pagedllm.cli`` adds `bench`).
AddCommands = Callable[[argparse._SubParsersAction], None]

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain in one sentence why a KV cache is split into blocks.",
    "List three prime numbers.",
]


def cmd_run(args: argparse.Namespace) -> None:
    llm = make_llm(args)
    print(llm.llm_engine.capacity_line())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        completion = out.outputs[0]
        print(f"\n>>> {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]")
    stats = llm.stats()
    print(f"\npeak blocks in use: {stats['peak_blocks_in_use']} of {stats['num_blocks']}; free now: {stats['num_free_blocks']}")


def cmd_generate(args: argparse.Namespace) -> None:
    llm = make_llm(args)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def cmd_serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.chat_utils import load_chat_template
    from pagedllm.entrypoints.openai.api_server import build_app

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}); give it once")
        args.model = args.model_tag
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.max_tokens_per_request is not None and args.max_tokens_per_request < 1:
        raise ValueError(f"--max-tokens-per-request must be at least 1, got {args.max_tokens_per_request}")
    if not args.engine_process and (args.api_server_count != 1 or args.restart_engine_on_failure):
        raise ValueError("--api-server-count and --restart-engine-on-failure need the engine-core process; "
                         "drop --no-engine-process")
    from pagedllm.entrypoints.serve_setup import (ServerStopper, api_keys_of, server_drain, run_uvicorn,
                                                  served_adapters, served_model_names, server_state, uvicorn_options)

    api_keys = api_keys_of(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_keys:
        logger.warning("serving on %s without --api-key: anyone who can reach this port can use the model",
                       args.host)
    options = engine_options_from_args(args)
    EngineConfig.from_options(**options)  # bad flags stop serve before it listens
    load_chat_template(args.chat_template)  # and so does a bad template, before a core process starts
    served_adapters(args)  # and malformed --lora-modules (each adapter is checked once the engine is up)
    names = served_model_names(args)
    load_engine = _encoder_loader(args, options)
    if load_engine is None and args.data_parallel_size != 1:
        sys.exit(_serve_data_parallel(args))
    if load_engine is None and args.engine_process:
        from pagedllm.entrypoints.serve_processes import serve_with_engine_process

        sys.exit(serve_with_engine_process(args, names))
    stop_server = ServerStopper()
    state = server_state(args, names, load_engine or (lambda: _load_served_engine(args, names[0])), stop_server)
    run_uvicorn(build_app(state, args.allowed_origins), uvicorn_options(args), stop_server,
                server_drain(args, state))
    if state.async_engine is not None:  # finish the disk tier's queued writes, close the event sockets
        state.async_engine.shutdown()
    if state.load_error is not None:
        sys.exit(1)


def _encoder_loader(args: argparse.Namespace, options: dict) -> Callable[[], Any] | None:
    """What loads an encoder checkpoint's engine-less client (``pooling/encoder_server.py``), served
    in this process; None: the model runs on an engine."""
    from pagedllm.entrypoints.pooling_api import encoder_runner_for, is_encoder_model

    if not is_encoder_model(args.model, options):
        return None
    if args.data_parallel_size != 1 or args.api_server_count != 1:
        raise ValueError("an encoder-only model is served by one API server without an engine: drop "
                         "--data-parallel-size and --api-server-count")
    from pagedllm.entrypoints.openai.pooling.encoder_server import EncoderEngineClient

    return lambda: EncoderEngineClient(encoder_runner_for(args.model, options))


def _serve_data_parallel(args: argparse.Namespace) -> int:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.api_server_count != 1 or not args.engine_process:
        raise ValueError("--data-parallel-size runs each replica with its own engine-core process and one API "
                         "server; leave out --api-server-count and --no-engine-process")
    from pagedllm.entrypoints.router.launch import serve_data_parallel

    return serve_data_parallel(args)


def _load_served_engine(args: argparse.Namespace, model_name: str) -> LLMEngine:
    """The engine of ``pagedllm serve``, built while the server already answers
    /health with 503 (a failed load stops the server: ``ServerState.on_load_failure``)."""
    from pagedllm.metrics import LoggingStatLogger

    engine = make_llm(args).llm_engine  # it logs the capacity line as it starts
    engine.stats_reporter.configure(model_name, args.metrics_namespace)
    if not args.disable_log_stats:
        engine.stats_reporter.loggers.append(LoggingStatLogger(args.log_stats_interval))
    return engine


def cmd_explain(args: argparse.Namespace) -> None:
    from pagedllm.core.kv_arithmetic import GIB, KVShape, explain, explain_groups

    explicit = (args.layers, args.kv_heads, args.head_dim)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError("give all of --layers, --kv-heads and --head-dim, or none (then the model's are used)")
    context = args.context
    layer_windows: list = []  # each layer's attention (``model.shapes.layer_attention_of``)
    if explicit[0] is None:
        from pagedllm.model.shapes import head_dim_of, layer_attention_of, num_kv_heads_of
        from pagedllm.model.loader import load_checkpoint

        config = load_checkpoint(args.model).config
        explicit = (config.num_hidden_layers, num_kv_heads_of(config), head_dim_of(config))
        layer_windows = layer_attention_of(config)
        context = context or config.max_position_embeddings
        print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}")
    shape = KVShape(*explicit, dtype=args.dtype, block_size=args.block_size)
    pool = None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB)
    lines = explain(shape, context=context or 4096, chat_tokens=args.chat_tokens, pool_bytes=pool, n=args.n,
                    prompt_tokens=args.prompt_tokens, sessions=args.sessions,
                    shared_prefix_tokens=args.shared_prefix_tokens)
    if layer_windows:
        lines += explain_groups(shape, layer_windows, context or 4096)
    for line in lines:
        print(line)


def cmd_worker(args: argparse.Namespace) -> None:
    from pagedllm.worker.tp_worker import main_from_environment

    main_from_environment(args.distributed_init_method, args.rank, args.world_size, args.timeout, args.device)
    # The rank left its group cleanly; skip interpreter finalization, where gloo's
    # threads can still drop work holding tensors and abort the process (SIGABRT,
    # "terminate called without an active exception": pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_parser(*more_commands: AddCommands) -> argparse.ArgumentParser:
    """The serving commands, then each of ``more_commands``."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generation_parsers(commands)
    _add_serve_parser(commands)
    _add_explain_parser(commands)
    _add_worker_parser(commands)
    for add_commands in more_commands:
        add_commands(commands)
    return parser


def _add_generation_parsers(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="generate for a few demo prompts on the default model")
    add_engine_args(run)
    run.add_argument("--max-tokens", type=int, default=48)
    run.set_defaults(func=cmd_run)

    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model to serve, as `vllm serve MODEL` (same as --model)")
    add_engine_args(serve)
    serve.add_argument("--host", default="0.0.0.0", help="address to bind (default: every interface, as vLLM; "
                                                         "127.0.0.1 keeps the server local)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help="require this bearer token on /v1 endpoints (repeatable; default: $PAGEDLLM_API_KEY)")
    serve.add_argument("--api-keys-file", default=None,
                       help="JSON object {api_key: tenant}: each tenant gets a server-side cache_salt")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="names a request's model may use; the first is reported in responses "
                            "(default: the model path)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH", help="LoRA adapters a request's "
                       "model selects (needs --enable-lora): name=path or vLLM's JSON {name, path, base_model_name}")
    serve.add_argument("--allowed-origins", nargs="+", default=None,
                       help="browser origins CORS allows, or '*' (default: no CORS headers)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="info logs one access line per request (default: %(default)s)")
    serve.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle connection is kept")
    add_shutdown_timeout_option(serve)
    serve.add_argument("--ssl-keyfile", default=None, help="TLS private key file (serve https)")
    serve.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    serve.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    serve.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    serve.add_argument("--metrics-namespace", default="pagedllm", choices=["pagedllm", "vllm"],
                       help="prefix of the /metrics names; vllm gives vLLM's exact names for its dashboards")
    serve.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    serve.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between throughput log lines while requests are in flight")
    _add_request_options(serve)
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine core (scheduler, runner, outputs) in a process of its own, reached over "
                            "ZMQ (the default); with --no-engine-process the engine loop runs in a thread of the "
                            "API server")
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="API server processes sharing the port in front of the one engine core (default 1)")
    serve.add_argument("--restart-engine-on-failure", action="store_true",
                       help="start a new engine core when it dies (open requests still fail with a 503); "
                            "without it the server exits with status 1")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="run N whole engine replicas (each its own processes and KV pool, with 1/N of the "
                            "cores) behind a prefix-aware router on this port (default 1: no router)")
    serve.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                       help="mp: replicas are processes on this machine; ray: Ray actors placed on the "
                            "cluster's nodes (default: %(default)s)")
    serve.add_argument("--ray-address", default=None,
                       help="the Ray cluster to place replicas on (HEAD:6379, as `ray start --address`); "
                            "default: a local Ray instance")
    from pagedllm.entrypoints.router.router_command import add_routing_options

    add_routing_options(serve)
    serve.set_defaults(func=cmd_serve)


def _add_request_options(serve: argparse.ArgumentParser) -> None:
    """How the server reads and answers requests: the chat template, the work cap, the
    reasoning parser, the Responses API's store."""
    serve.add_argument("--chat-template", default=None,
                       help="the chat template to use instead of the model's: a file, inline Jinja, or 'hermes' "
                            "(the shipped Hermes/Qwen tool-calling template)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests send their own chat_template (Jinja run in a sandbox; off by default)")
    serve.add_argument("--max-tokens-per-request", type=int, default=None, metavar="N",
                       help="the most tokens one request may make the engine compute: its prompts' tokens (once "
                            "per choice with prompt logprobs) plus max_tokens for each of its n (or best_of) "
                            "sequences; over it is a 400 (default: 16384, or --max-model-len if longer)")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split a reasoning model's <think>...</think> from its answer: chat's reasoning_content, "
                            "Responses reasoning items, Messages thinking blocks; grammars and tool parsing start "
                            "after the thinking")
    serve.add_argument("--responses-store-max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                       help="Responses API: stored responses kept per tenant (LRU; 0: store nothing; "
                            "default: %(default)s)")
    serve.add_argument("--responses-store-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help="Responses API: bytes of stored responses (JSON, with their conversations) kept per "
                            "tenant (LRU; default: %(default)s)")


def _add_explain_parser(commands: argparse._SubParsersAction) -> None:
    ex = commands.add_parser("explain", help="the KV-cache arithmetic for a model or a shape given by flags")
    ex.add_argument("--model", default=None, help="read the shape from this model (default: the embedded SmolLM2)")
    ex.add_argument("--layers", type=int, default=None)
    ex.add_argument("--kv-heads", type=int, default=None)
    ex.add_argument("--head-dim", type=int, default=None)
    ex.add_argument("--dtype", default=EngineConfig.dtype, choices=get_args(DType))
    ex.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    ex.add_argument("--context", type=int, default=None, help="max_model_len for the contiguous reservation "
                                                              "(default: the model's, or 4096)")
    ex.add_argument("--chat-tokens", type=int, default=300, help="a request's actual length, for the waste figures")
    ex.add_argument("--kv-memory-gib", type=float, default=None, help="a pool size to count blocks and tokens in")
    ex.add_argument("--n", type=int, default=4, help="parallel samples sharing one prompt")
    ex.add_argument("--prompt-tokens", type=int, default=2000)
    ex.add_argument("--sessions", type=int, default=500, help="sessions sharing one cached prefix")
    ex.add_argument("--shared-prefix-tokens", type=int, default=3000)
    ex.set_defaults(func=cmd_explain)


def _add_worker_parser(commands: argparse._SubParsersAction) -> None:
    wk = commands.add_parser("worker", help="a tensor-parallel rank for an engine started with "
                                            "--distributed-init-method (or launched by torchrun); it receives "
                                            "the engine's configuration")
    wk.add_argument("--distributed-init-method", default=None, help="the engine's, e.g. tcp://HOST:PORT (default env://)")
    wk.add_argument("--rank", type=int, default=None, help="1..N-1 (default: $RANK)")
    wk.add_argument("--world-size", type=int, default=None, help="N (default: $WORLD_SIZE)")
    wk.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    wk.add_argument("--timeout", type=float, default=EngineConfig.distributed_timeout_s,
                    help="seconds any collective may wait")
    wk.set_defaults(func=cmd_worker)


def main(argv: list[str] | None = None, more_commands: Sequence[AddCommands] = ()) -> None:
    """Run the command ``argv`` names (``sys.argv[1:]`` when None): one of the
    serving commands or of ``more_commands``."""
    run_command(build_parser(*more_commands), argv)


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None, program: str = "pagedllm") -> None:
    """Parse ``argv`` (``sys.argv[1:]`` when None) and call its command's ``func``;
    a ValueError is printed as ``error: ...`` and exits with status 2. The
    command sees the words as ``args.argv`` and ``program`` as ``args.program``
    (``--record`` writes both down)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv, args.program = argv, program
    try:
        args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

"""What every API server of `pagedllm serve` is built from: its state (served
names, keys, chat settings) and its uvicorn options, read from the flags. The
serve command and the API server processes it starts both use these."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.entrypoints.draining import Drain
    from pagedllm.entrypoints.openai.admin.lora import ServedAdapters
    from pagedllm.entrypoints.openai.common.state import ServerState


def add_shutdown_timeout_option(parser: argparse.ArgumentParser) -> None:
    """``--shutdown-timeout``, shared by ``pagedllm serve`` and ``pagedllm router``."""
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds the requests in flight may still run (new ones get 503); then "
                             "the rest end with finish_reason abort and the server exits 0 (default: %(default)s, "
                             "Kubernetes' grace period)")


def served_model_names(args: argparse.Namespace) -> list[str]:
    return args.served_model_name or ["SmolLM2-135M-Instruct" if args.model is None else args.model]


class ServerStopper:
    """Stops this process's uvicorn server gracefully, from its event loop (open
    streams end first). Not a SIGTERM to ourselves: uvicorn re-raises a signal it
    caught once it has shut down, so the process would end killed by it rather
    than with the status `pagedllm serve` returns. Calls before the server runs
    are remembered."""

    def __init__(self) -> None:
        self._server: Any = None
        self.stopped = False

    def attach(self, server: Any) -> None:
        self._server = server
        server.should_exit = self.stopped

    def __call__(self) -> None:
        self.stopped = True
        if self._server is not None:
            self._server.should_exit = True


def server_state(args: argparse.Namespace, names: list[str], load_engine: Callable[[], Any],
                 stop_server: ServerStopper) -> ServerState:
    """The state of one API server of ``pagedllm serve`` (the chat template is read here: a bad one
    fails fast); a failed load stops the server (``stop_server``), which then exits with status 1."""
    from pagedllm.entrypoints.chat_utils import ChatSettings, load_chat_template
    from pagedllm.entrypoints.openai.responses.store import ResponseStore
    from pagedllm.entrypoints.openai.common.state import ServerState

    chat = ChatSettings(load_chat_template(args.chat_template), args.trust_request_chat_template)
    return ServerState(served_model_name=names[0], api_keys=api_keys_of(args), model_aliases=names[1:], chat=chat,
                       load_engine=load_engine, on_load_failure=stop_server,
                       engine_settings={"block_size": args.block_size, "kv_events": args.kv_events_config},
                       adapters=served_adapters(args), model_root=args.model, reasoning_parser=args.reasoning_parser,
                       max_tokens_per_request=args.max_tokens_per_request,
                       responses_store=ResponseStore(args.responses_store_max_entries, args.responses_store_max_bytes))


def served_adapters(args: argparse.Namespace) -> ServedAdapters | None:
    """The adapters of ``--enable-lora`` (its ``--lora-modules``, loaded once the engine is
    ready); None without LoRA. ``ValueError`` naming the flag for a malformed module, or
    for ``--lora-modules`` without ``--enable-lora``."""
    from pagedllm.entrypoints.openai.admin.lora import ServedAdapters, parse_lora_modules

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine serves adapters only with it)")
    return ServedAdapters(parse_lora_modules(args.lora_modules or [])) if args.enable_lora else None


def run_uvicorn(app: Any, options: dict[str, Any], stop_server: ServerStopper, drain: Drain,
                sockets: list | None = None) -> None:
    """Serve ``app`` until SIGTERM, SIGINT or ``stop_server()`` stops it, then return.

    SIGTERM drains first (``draining``): new requests are refused, those in flight get
    ``drain``'s timeout, then what is left is ended.

    uvicorn re-raises the signal that stopped it once it has shut down, to the handler
    that was there before it ran: with the default one the process would die there, and
    the caller's cleanup (stopping the engine core, removing its socket folder) would
    never run. A handler that ignores it is put there for the run, so a signal stops the
    server gracefully and returns here like ``stop_server()`` does. Call from the main thread."""
    import signal

    import uvicorn

    from pagedllm.entrypoints.draining import DrainingServer, RefuseWhileDraining

    server = DrainingServer(uvicorn.Config(RefuseWhileDraining(app, drain), **options), drain)
    stop_server.attach(server)
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def server_drain(args: argparse.Namespace, state: ServerState) -> Drain:
    """The API server's drain on SIGTERM: ``--shutdown-timeout``, then the engine ends
    its requests in flight (finish_reason "abort", a final event each); none while it
    is still loading."""
    from pagedllm.entrypoints.draining import Drain

    return Drain(args.shutdown_timeout,
                 lambda: state.async_engine.end_all_requests() if state.async_engine is not None else 0)


def _ignore_signal(signum: int, frame: Any) -> None:
    """The re-raised stop signal, after uvicorn's graceful shutdown (``run_uvicorn``)."""


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``uvicorn.Config`` gets from the serve flags."""
    return dict(host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=args.timeout_keep_alive, ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def api_keys_of(args: argparse.Namespace) -> dict[str, str | None]:
    """API key -> tenant: --api-key (or $PAGEDLLM_API_KEY) keys have none, --api-keys-file's have theirs."""
    import os

    keys = args.api_key or ([os.environ["PAGEDLLM_API_KEY"]] if os.environ.get("PAGEDLLM_API_KEY") else [])
    api_keys: dict[str, str | None] = dict.fromkeys(keys)
    if args.api_keys_file:
        api_keys.update(read_tenants_file(args.api_keys_file))
    return api_keys


def read_tenants_file(path: str) -> dict[str, str]:
    """An --api-keys-file: a JSON object {api_key: tenant}."""
    import json

    with open(path, encoding="utf-8") as f:
        tenants = json.load(f)
    if not isinstance(tenants, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tenants.items()):
        raise ValueError(f"{path}: expected a JSON object mapping API keys to tenant names")
    return tenants

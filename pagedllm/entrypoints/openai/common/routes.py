"""Every HTTP path the API server answers, in one table: the server registers
its routes from these names and the fleet router reads the same table to know
which requests carry a prompt to hash, so the two never disagree on a path
(``tests/test_code_limits.py`` keeps path literals out of other modules)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One path: the API folder of ``entrypoints/openai`` that serves it, and whether
    it is a generation whose prompt the router reads to pick a replica."""

    path: str
    api: str
    routed: bool = False


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
STORED_RESPONSE = RESPONSES + "/{response_id}"
MESSAGES = "/v1/messages"
COUNT_TOKENS = MESSAGES + "/count_tokens"
HEALTH = "/health"
VERSION = "/version"
SERVER_INFO = "/server_info"
METRICS = "/metrics"
MODELS = "/v1/models"
DASHBOARD = "/dashboard"
KV_POOL = "/v1/kv_pool"
RESET_PREFIX_CACHE = "/reset_prefix_cache"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
LOAD_LORA_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/v1/unload_lora_adapter"

ROUTES = (
    Route(CHAT, "chat", routed=True),
    Route(COMPLETIONS, "completions", routed=True),
    Route(RESPONSES, "responses", routed=True),
    Route(STORED_RESPONSE, "responses"),
    Route(MESSAGES, "messages", routed=True),
    Route(COUNT_TOKENS, "messages"),
    Route(HEALTH, "admin"),
    Route(VERSION, "admin"),
    Route(SERVER_INFO, "admin"),
    Route(METRICS, "admin"),
    Route(MODELS, "admin"),
    Route(DASHBOARD, "admin"),
    Route(KV_POOL, "admin"),
    Route(RESET_PREFIX_CACHE, "admin"),
    Route(TOKENIZE, "admin"),
    Route(DETOKENIZE, "admin"),
    Route(LOAD_LORA_ADAPTER, "admin"),
    Route(UNLOAD_LORA_ADAPTER, "admin"),
)

# The generations: their bodies carry the prompt the router hashes.
ROUTED_PATHS = frozenset(route.path for route in ROUTES if route.routed)


def is_under(path: str, root: str) -> bool:
    """``path`` is ``root`` or one of its sub-paths (``/v1/messages/count_tokens``)."""
    return path == root or path.startswith(root + "/")

"""Every HTTP path the API server answers, in one table: the server registers
its routes from these names and the fleet router reads the same table to know
which requests carry a prompt to hash, so the two never disagree on a path
(``tests/test_code_limits.py`` keeps path literals out of other modules)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One path: the API folder of ``entrypoints/openai`` that serves it, whether
    it is a generation whose prompt the router reads to pick a replica, and the
    ``--runner`` it needs (None: any server answers it)."""

    path: str
    api: str
    routed: bool = False
    runner: str | None = None


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
EMBEDDINGS = "/v1/embeddings"
SCORE = "/score"
V1_SCORE = "/v1/score"
RERANK = "/rerank"
V1_RERANK = "/v1/rerank"
V2_RERANK = "/v2/rerank"
CLASSIFY = "/classify"
POOLING = "/pooling"

ROUTES = (
    Route(CHAT, "chat", routed=True, runner="generate"),
    Route(COMPLETIONS, "completions", routed=True, runner="generate"),
    Route(RESPONSES, "responses", routed=True, runner="generate"),
    Route(STORED_RESPONSE, "responses"),
    Route(MESSAGES, "messages", routed=True, runner="generate"),
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
    # Not routed by prefix: the router's prompt reader knows the generation bodies, and the prefix a
    # pooling request shares (a rerank's query) is shared within the request, on whichever replica runs it.
    *(Route(path, "pooling", runner="pooling")
      for path in (EMBEDDINGS, SCORE, V1_SCORE, RERANK, V1_RERANK, V2_RERANK, CLASSIFY, POOLING)),
)

# The generations: their bodies carry the prompt the router hashes.
ROUTED_PATHS = frozenset(route.path for route in ROUTES if route.routed)


# The --runner each path needs (the others: any).
RUNNER_OF_PATH = {route.path: route.runner for route in ROUTES if route.runner is not None}


def is_under(path: str, root: str) -> bool:
    """``path`` is ``root`` or one of its sub-paths (``/v1/messages/count_tokens``)."""
    return path == root or path.startswith(root + "/")

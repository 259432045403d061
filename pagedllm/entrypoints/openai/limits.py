"""The bounds of request fields that come from the engine: its max_model_len,
max_num_seqs, max_logprobs, scheduling policy and vocabulary. ``check_limits``
refuses a request outside one (a 400 naming the field), and ``bound_schema``
writes the same numbers into the OpenAPI document, so the two cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.engine_info import EngineInfo
from pagedllm.entrypoints.openai.errors import APIError

# Request fields holding token ids (every integer inside is one): the vocabulary bounds them.
TOKEN_ID_FIELDS = ("prompt", "tokens", "stop_token_ids", "allowed_token_ids")


@dataclass(frozen=True)
class Limit:
    maximum: int
    source: str  # the server flag that sets it, for the 400's message
    minimum: int | None = None  # None: the request model's own bound (``protocol``) stands


def field_limits(info: EngineInfo) -> dict[str, Limit]:
    """Each bounded integer field's allowed range on this server."""
    seqs = Limit(info.max_num_seqs, "--max-num-seqs")
    length = Limit(info.max_model_len, "--max-model-len")
    logprobs = Limit(info.max_logprobs, "--max-logprobs")
    limits = {"n": seqs, "best_of": seqs, "max_tokens": length, "max_completion_tokens": length,
              "min_tokens": length, "truncate_prompt_tokens": length, "logprobs": logprobs, "top_logprobs": logprobs,
              "prompt_logprobs": logprobs}
    if info.scheduling_policy != "priority":
        limits["priority"] = Limit(0, "priorities need --scheduling-policy priority", minimum=0)
    return limits


def check_limits(info: EngineInfo, body: BaseModel) -> None:
    """A 400 naming the first field of ``body`` outside this server's limits."""
    for name, limit in field_limits(info).items():
        value = getattr(body, name, None)
        # type() is int: chat's logprobs is a boolean, not a count
        if type(value) is not int:
            continue
        if value > limit.maximum or (limit.minimum is not None and value < limit.minimum):
            allowed = f"<= {limit.maximum}" if limit.minimum is None else f"in [{limit.minimum}, {limit.maximum}]"
            raise APIError(400, f"{name} must be {allowed} on this server ({limit.source}), got {value}", param=name)
    vocab = info.vocab_size
    for name in TOKEN_ID_FIELDS:
        outside = [t for t in _integers(getattr(body, name, None)) if t >= vocab]
        if outside:
            raise APIError(400, f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})", param=name)


def _integers(value: Any) -> list[int]:
    """The integers in a field's value (a token id list, or a list of them)."""
    if type(value) is int:
        return [value]
    return [t for item in value for t in _integers(item)] if isinstance(value, list) else []


def bound_schema(info: EngineInfo, schema: dict[str, Any]) -> None:
    """Write this server's limits into the request schemas of an OpenAPI
    document (``components.schemas``) as ``maximum``s, in place."""
    limits = field_limits(info)
    limits.update(dict.fromkeys(TOKEN_ID_FIELDS, Limit(info.vocab_size - 1, "the vocabulary")))
    for component in schema.get("components", {}).get("schemas", {}).values():
        for name, field_schema in component.get("properties", {}).items():
            if name in limits:
                _bound_integers(field_schema, limits[name])


def _bound_integers(node: Any, limit: Limit) -> None:
    """Every integer type in ``node`` (anyOf branches and array items included) gets ``limit``'s bounds."""
    if isinstance(node, list):
        for item in node:
            _bound_integers(item, limit)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(node.get("maximum", limit.maximum), limit.maximum)
            if limit.minimum is not None:
                node["minimum"] = max(node.get("minimum", limit.minimum), limit.minimum)
        for value in node.values():
            _bound_integers(value, limit)

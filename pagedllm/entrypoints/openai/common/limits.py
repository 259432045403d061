"""The bounds of request fields that come from the engine: its max_model_len,
max_num_seqs, max_logprobs, scheduling policy and vocabulary. ``check_limits``
refuses a request outside one (a 400 naming the field), and ``bound_schema``
writes the same numbers into the OpenAPI document, so the two cannot disagree.

One request's work is capped too (``--max-tokens-per-request``,
``check_request_tokens``): a product of fields, which JSON Schema cannot state,
so the document gives the rule and the number in words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.engine_info import EngineInfo
from pagedllm.entrypoints.openai.common.errors import APIError
from pagedllm.sampling_params import SamplingParams

# Request fields holding token ids (every integer inside is one, and logit_bias's keys): the
# vocabulary bounds them.
TOKEN_ID_FIELDS = ("prompt", "tokens", "stop_token_ids", "allowed_token_ids", "logit_bias")


@dataclass(frozen=True)
class Limit:
    maximum: int
    source: str  # the server flag that sets it, for the 400's message
    minimum: int | None = None  # None: the request model's own bound (``protocol``) stands


# The default of --max-tokens-per-request, raised to max_model_len when that is longer (so a
# single-sequence request always fits). 16384 tokens are two whole contexts of the default
# model (SmolLM2, 8192), about half a minute of a 2-core CPU's batched throughput (~500 tok/s):
# one request can no longer hold every sequence slot for minutes (n: 256 x max_tokens: 256),
# while n up to 2 without max_tokens, or n: 16 with max_tokens: 512 and a prompt of up to
# 8000 tokens, still run.
DEFAULT_MAX_TOKENS_PER_REQUEST = 16384
TOKENS_PER_REQUEST_FLAG = "--max-tokens-per-request"


def max_tokens_per_request(info: EngineInfo, configured: int | None) -> int:
    """The work cap of one request on this server: ``configured`` (the flag), else the default."""
    return configured if configured is not None else max(DEFAULT_MAX_TOKENS_PER_REQUEST, info.max_model_len)


def request_tokens(info: EngineInfo, prompt_lengths: list[int], params: SamplingParams) -> int:
    """The tokens a request makes the engine compute, at most: for each prompt, its
    tokens (kept by ``truncate_prompt_tokens``), counted once per returned choice
    when the choices carry its logprobs (``prompt_logprobs``, or echo with
    ``logprobs``), plus ``max_tokens`` (what fits in ``max_model_len`` after the
    prompt; all of it when unset) for each of its ``best_of`` (else ``n``) sequences."""
    total = 0
    for length in prompt_lengths:
        length = _kept_prompt_length(length, params.truncate_prompt_tokens, info.max_model_len)
        if length >= info.max_model_len:
            continue  # never runs: the engine refuses it with a 400 that says why
        room = info.max_model_len - length
        generated = room if params.max_tokens is None else min(params.max_tokens, room)
        scored = length * params.n if params.prompt_logprobs is not None else length
        total += scored + params.num_sequences * generated
    return total


def _kept_prompt_length(length: int, truncate: int | None, max_model_len: int) -> int:
    if truncate is None:
        return length
    return min(length, max_model_len - 1 if truncate == -1 else truncate)


def check_request_tokens(info: EngineInfo, cap: int, prompt_lengths: list[int], params: SamplingParams,
                         max_tokens_field: str = "max_tokens") -> None:
    """A 400 when the request's work (``request_tokens``) is over ``cap``
    (``--max-tokens-per-request``). Its ``param`` names the field to lower:
    ``best_of`` or ``n`` when it runs several sequences, else ``prompt`` for
    several prompts, else the prompt or ``max_tokens_field``."""
    total = request_tokens(info, prompt_lengths, params)
    if total <= cap:
        return
    if params.best_of is not None and params.best_of > 1:
        param = "best_of"
    elif params.n > 1:
        param = "n"
    elif len(prompt_lengths) > 1 or sum(prompt_lengths) > cap:
        param = "prompt"
    else:
        param = max_tokens_field
    sequences = params.num_sequences
    per_sequence = "until the context is full" if params.max_tokens is None else f"up to {params.max_tokens} tokens"
    scored = f" x {params.n} choices (prompt logprobs)" if params.prompt_logprobs is not None else ""
    raise APIError(400, f"this request asks for up to {total} tokens ({len(prompt_lengths)} prompt(s) of "
                        f"{sum(prompt_lengths)} tokens{scored}, then {sequences} sequence(s) per prompt of "
                        f"{per_sequence}), more than the {cap} this server allows per request "
                        f"({TOKENS_PER_REQUEST_FLAG}); lower {param}", param=param)


# The request schemas whose routes check the work cap (``check_request_tokens``), and their fields in it.
WORK_CAPPED_SCHEMAS = {
    "CompletionRequest": ("n", "best_of", "max_tokens", "prompt", "prompt_logprobs", "echo"),
    "ChatCompletionRequest": ("n", "best_of", "max_tokens", "max_completion_tokens", "messages"),
    # One sequence each: the prompt (with a stored conversation before it) and the output length.
    "ResponsesRequest": ("input", "max_output_tokens"),
    "MessagesRequest": ("messages", "max_tokens"),
}


def document_request_tokens(schema: dict[str, Any], cap: int) -> None:
    """Write the work cap into the request schemas of an OpenAPI document, in
    place: the rule in words (a product, which JSON Schema cannot state) with
    this server's number, and the number as ``x-max-tokens-per-request``."""
    rule = (f"One request may make the engine compute at most {cap} tokens ({TOKENS_PER_REQUEST_FLAG}): "
            "over its prompts, each prompt's tokens (counted once per choice when the choices carry prompt "
            "logprobs: prompt_logprobs, or echo with logprobs) plus max_tokens (what fits in the context after "
            "the prompt; all of it when unset) for each of its best_of (else n) sequences. Over it: a 400 "
            "whose param names the field to lower.")
    components = schema.get("components", {}).get("schemas", {})
    note = f"Counts towards the request's work cap of {cap} tokens ({TOKENS_PER_REQUEST_FLAG})."
    for name, fields in WORK_CAPPED_SCHEMAS.items():
        component = components.get(name)
        if component is None:
            continue
        component["description"] = f"{component['description']}\n\n{rule}" if component.get("description") else rule
        component["x-max-tokens-per-request"] = cap
        for field in fields:
            field_schema = component.get("properties", {}).get(field)
            if field_schema is not None:
                said = field_schema.get("description")
                field_schema["description"] = f"{said.rstrip('.')}. {note}" if said else note


def field_limits(info: EngineInfo) -> dict[str, Limit]:
    """Each bounded integer field's allowed range on this server."""
    seqs = Limit(info.max_num_seqs, "--max-num-seqs")
    length = Limit(info.max_model_len, "--max-model-len")
    logprobs = Limit(info.max_logprobs, "--max-logprobs")
    limits = {"n": seqs, "best_of": seqs, "max_tokens": length, "max_completion_tokens": length,
              "max_output_tokens": length,
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
    """The integers in a field's value (a token id list, or a list of them; logit_bias's
    keys, token ids in decimal)."""
    if type(value) is int:
        return [value]
    if isinstance(value, dict):
        return [int(key) for key in value]
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
            if name == "logit_bias":
                _bound_token_keys(field_schema, info.vocab_size)


def _bound_token_keys(node: Any, vocab_size: int) -> None:
    """logit_bias's object (in its ``anyOf``): keys are token ids in decimal, below ``vocab_size``."""
    if isinstance(node, list):
        for item in node:
            _bound_token_keys(item, vocab_size)
    elif isinstance(node, dict):
        if node.get("type") == "object" and "propertyNames" in node:
            node["propertyNames"] = {"pattern": decimal_range_pattern(vocab_size - 1)}
        for value in node.values():
            _bound_token_keys(value, vocab_size)


def decimal_range_pattern(maximum: int) -> str:
    """A regular expression matching exactly the integers 0..``maximum`` written in decimal
    without leading zeros (as JSON Schema, Python and Rust read it)."""
    digits = str(maximum)
    branches = ["0"] if maximum >= 0 else []
    # Shorter numbers: any, without a leading zero.
    branches += ["[1-9]" + ("[0-9]" * (length - 1) if length > 1 else "") for length in range(1, len(digits))]
    # As long as maximum: a common prefix, then a smaller digit, then anything; or maximum itself.
    for i, digit in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            smaller = f"[{low}-{int(digit) - 1}]" if int(digit) - 1 > low else str(low)
            branches.append(digits[:i] + smaller + "[0-9]" * (len(digits) - i - 1))
    if maximum > 0:
        branches.append(digits)
    return "^(" + "|".join(branches) + ")$"


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

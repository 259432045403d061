"""Schemathesis hooks for the fuzz runs of the server (tests/entrypoints/test_openapi_schemathesis.py,
and the longer run in docs/security.md), loaded through tests/entrypoints/schemathesis.toml.

The document states every rule JSON Schema can state, the rules between fields
included (``protocol``'s ``json_schema_extra``, ``openapi_doc``), so a
schema-valid request must be accepted (2xx). These hooks are the narrow
exceptions, each for a rule JSON Schema cannot state:

``before_call`` adjusts a valid generated request, keeping it valid:
- it asks for at most ``LONGEST`` tokens (one asking for none gets the server's
  default, ``--override-generation-config``), so a run stays short;
- rules that compare two values: ``best_of`` >= ``n``, ``min_tokens`` <= the
  tokens asked for;
- one constraint on the output at a time (``response_format``,
  ``structured_outputs``, ``guided_*``, a required or named ``tool_choice``),
  and none beside ``ignore_eos`` or ``min_tokens``: the fields' descriptions
  say so, but as JSON Schema it is 7 cases, which beside a request's other
  rules and fields takes schemathesis's generator past what it models (its
  canonical form gives up and the operation goes unfuzzed); the first
  constraint is kept, the others set to null, and ``ignore_eos`` and
  ``min_tokens`` to their defaults;
- ``continue_final_message`` continues the last message: that must be the
  assistant's (an array's last item is out of JSON Schema's reach), else it is
  turned off, and no generation prompt is added, so ``add_generation_prompt``
  is set to false (that half is stated in the document too);
- an assistant's earlier tool call carries its ``arguments`` as JSON text
  (JSON Schema cannot say a string holds JSON): one that does not parse is
  sent as that text quoted as a JSON string.

``filter_failure`` drops a "schema-valid request rejected" failure only when the
400 names one of ``RULES_JSON_SCHEMA_CANNOT_STATE`` (every other check still
runs on that case), and a "schema-violating request accepted" one only when the
body is valid against the document after all (a false negative case of
schemathesis's: it found one, a chat message list for /tokenize).

Invalid requests go out as generated: the server must refuse them before any
token is generated."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema_rs
import schemathesis
from schemathesis import Case, HookContext

LONGEST = 8
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# protocol.STRUCTURED_OUTPUT_FIELDS, in its order
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")

# The 400s of rules that JSON Schema cannot state, by what their message says.
RULES_JSON_SCHEMA_CANNOT_STATE = {
    # A prompt's length in tokens (the tokenizer's business, not the JSON's).
    "prompt too long for the model": r"the prompt has \d+ tokens but max_model_len is",
    "text of no tokens (characters the tokenizer drops)": r"^the prompt is empty \(0 tokens\)",
    "prompt + max_tokens larger than the whole KV pool": r"needs \d+ KV blocks.* but the whole pool has",
    # A product of fields and the prompts' lengths (the document says it in words).
    "the request's work over --max-tokens-per-request": r"\(--max-tokens-per-request\)",
    # Whether a schema, regular expression or grammar compiles (JSON Schema can only say it is a string / object).
    "a structured-output constraint that does not compile":
        r"^(response_format|structured_outputs|guided_json|guided_regex|guided_grammar|text\.format) is invalid: ",
    "a tool's parameters schema that does not compile": r"^tools: a function's parameters schema is invalid",
    # Relations between array items.
    "two tools of one name": r"^tools: two tools have the same function name",
    "a named tool choice that names no tool": r"^tool_choice names the function .* which is not in tools",
    # What the served model takes (its architecture, not the JSON): an image part sent to a text-only model.
    "an image for a text-only model": r"this model takes text only",
    # Jinja: the chat template's own checks (raise_exception), e.g. roles that must alternate.
    "the chat template's own checks": r"^messages: the chat template refused this conversation",
}
_RULES = re.compile("|".join(f"(?:{pattern})" for pattern in RULES_JSON_SCHEMA_CANNOT_STATE.values()))
# The 404s (error codes) of ids only the server's state decides: a stored response's (the Responses
# API's GET/DELETE /v1/responses/{id} and previous_response_id); a made-up id is stored nowhere.
STATE_NOT_FOUND_CODES = ("response_not_found", "previous_response_not_found")


def _whole(value: Any) -> int | None:
    """``value`` as an integer if JSON Schema counts it as one (``2`` or ``2.0``, as the server does), else None."""
    if type(value) is int or (type(value) is float and value.is_integer()):
        return int(value)
    return None


def _asked_tokens(body: dict[str, Any]) -> int:
    """The tokens a (clamped) request asks for: what ``min_tokens`` must not exceed."""
    asked = [_whole(body.get(name)) for name in ("max_completion_tokens", "max_tokens")]
    asked = [tokens for tokens in asked if tokens is not None]
    if not asked:
        return LONGEST  # the server's default (--override-generation-config), or none
    return max(asked[0], 1)  # max_tokens 0 (echo alone) still samples one token


def _constrains(name: str, value: Any) -> bool:
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") != "text"
    return value is not None


def _one_constraint(body: dict[str, Any]) -> None:
    constraints = [name for name in CONSTRAINT_FIELDS if _constrains(name, body.get(name))]
    for name in constraints[1:]:
        body[name] = None
    tool_choice = body.get("tool_choice")
    if constraints or tool_choice == "required" or isinstance(tool_choice, dict):
        body["ignore_eos"], body["min_tokens"] = False, 0


def _json_arguments(messages: Any) -> None:
    for message in messages if isinstance(messages, list) else []:
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    json.loads(function["arguments"] or "{}")
                except json.JSONDecodeError:
                    function["arguments"] = json.dumps(function["arguments"])


@schemathesis.hook
def before_call(context: HookContext, case: Case, kwargs: dict[str, Any]) -> None:
    """Right before sending, so that every case is seen, however it was made (a
    ``map_case`` hook misses some of the fuzzing phase's: a run met one asking
    for 500 tokens); schemathesis re-checks the case's validity after it."""
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return
    body = case.body
    for name in LENGTH_FIELDS:
        value = _whole(body.get(name))
        if value is not None and value > LONGEST:
            body[name] = LONGEST
    best_of, n = _whole(body.get("best_of")), _whole(body.get("n"))
    if best_of is not None and n is not None and best_of < n:
        body["best_of"] = body["n"]
    min_tokens = _whole(body.get("min_tokens"))
    if min_tokens is not None:
        body["min_tokens"] = min(min_tokens, _asked_tokens(body))
    if case.operation.path in GENERATION_PATHS:
        _one_constraint(body)
    messages = body.get("messages")
    if body.get("continue_final_message") is True and isinstance(messages, list) and messages:
        if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            body["add_generation_prompt"] = False
        else:
            body["continue_final_message"] = False
    _json_arguments(messages)


def _document_admits(case: Case) -> bool:
    """Whether the request's JSON body is valid against the document (as schemathesis validates)."""
    if not isinstance(case.body, dict):
        return False
    document = case.operation.schema.raw_schema
    operation = document["paths"][case.operation.path][case.operation.method.lower()]
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    return schema is not None and jsonschema_rs.Draft202012Validator({**document, **schema}).is_valid(case.body)


@schemathesis.hook
def filter_failure(context: HookContext, failure: Any, case: Case, response: Any) -> bool:
    """Keep every failure but a valid request's 400 for one of ``RULES_JSON_SCHEMA_CANNOT_STATE``
    and its 404 for one of ``STATE_NOT_FOUND_CODES``; and an "invalid" request the server
    accepted that is valid after all: schemathesis's negative mode mutates one branch of a
    ``oneOf`` (a chat message's role) and may send a body every branch still admits."""
    if failure.title == "Schema-violating request accepted" and _document_admits(case):
        return False
    if failure.title != "Schema-valid request rejected" or response.status_code not in (400, 404):
        return True
    try:
        error = json.loads(response.content)["error"]
        message, code = error["message"], error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return True
    if response.status_code == 404:
        return code not in STATE_NOT_FOUND_CODES
    return not (isinstance(message, str) and _RULES.search(message))

"""The server's OpenAPI document (``/openapi.json``), made to say what the
server does: FastAPI documents a 422 for every request body, but this server
answers a malformed request with a 400 in OpenAI's error shape (each route
documents its error statuses, see ``errors.error_responses``), the bounds
that come from the engine (``limits``) are written in as maximums, and the
rules that come from this server's settings (the served model names, its chat
template, its tokenizer) narrow the request schemas (``_document_server_rules``).
The rules between fields are in the request models (``protocol``'s
``json_schema_extra``). So a request the document admits is one the server
runs, but for what JSON Schema cannot say (tests/entrypoints/schemathesis_hooks.py
lists those)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.entrypoints.chat_utils import rendering_arguments
from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.common.limits import bound_schema, document_request_tokens
from pagedllm.entrypoints.openai.completions.serving import fim_token_names
from pagedllm.entrypoints.openai.common.state import ServerState

# FastAPI's components for its 422 answers, which this server never gives.
_UNUSED_COMPONENTS = ("HTTPValidationError", "ValidationError")
# The request schemas whose route answers a "model" it does not serve with a 404 (``check_model``).
MODEL_CHECKED_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
                         "ResponsesRequest", "MessagesRequest", "MessagesCountTokensRequest", "EmbeddingRequest",
                         "ScoreRequest", "RerankRequest", "ClassifyRequest", "PoolingRequest")
# The request schemas rendered by the chat template (``chat_prompt``), with the condition under
# which they are (None: always).
CHAT_TEMPLATE_SCHEMAS: dict[str, dict[str, Any] | None] = {
    "ChatCompletionRequest": None,
    "TokenizeRequest": {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
}
# The requests that always run on the server's own chat template (they cannot send one), with
# the tool_choice that calls no tool in each API's terms.
OWN_TEMPLATE_TOOL_CHOICE_NONE: dict[str, dict[str, Any]] = {
    "ResponsesRequest": {"enum": ["none", "auto"]},
    "MessagesRequest": {"$ref": "#/components/schemas/ToolChoiceNone"},
    "MessagesCountTokensRequest": {"$ref": "#/components/schemas/ToolChoiceNone"},
}


def install_openapi(app: FastAPI, state: ServerState) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = _published_names(get_openapi(title=app.title, version=app.version, description=app.description,
                                              routes=app.routes))
        _integer_bounds(schema)
        for operation in _operations(schema):
            operation["responses"].pop("422", None)
        for name in _UNUSED_COMPONENTS:
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        if state.async_engine is None:
            return schema  # the engine's limits are not known yet: not kept
        bound_schema(state.async_engine.info, schema)
        document_request_tokens(schema, state.request_token_cap)
        _document_server_rules(schema, state)
        _served_paths(schema, state)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _served_paths(schema: dict[str, Any], state: ServerState) -> None:
    """Drop the paths of the other ``--runner`` (a pooling server's generations, a generation server's
    pooling routes): the server answers them only with the 400 that says how to start it."""
    runner = "generate" if state.engine_info.pooler_spec is None else "pooling"
    for path, needs in routes.RUNNER_OF_PATH.items():
        if needs != runner:
            schema.get("paths", {}).pop(path, None)


# Chat's and Anthropic's AssistantMessage share a class name, so FastAPI names each component by
# its module's path. These are the names the document published before the modules moved into a
# folder per API: clients generated from it keep them, whatever the layout.
_PUBLISHED_NAMES = {
    "pagedllm__entrypoints__openai__chat__protocol__AssistantMessage":
        "pagedllm__entrypoints__openai__protocol_chat__AssistantMessage",
    "pagedllm__entrypoints__openai__messages__protocol__AssistantMessage":
        "pagedllm__entrypoints__openai__protocol_messages__AssistantMessage",
}


def _published_names(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its path-derived component names as published (keys, ``$ref``s, mappings)."""
    text = json.dumps(schema)
    for name, published in _PUBLISHED_NAMES.items():
        text = text.replace(f'"{name}"', f'"{published}"').replace(f'/{name}"', f'/{published}"')
    return json.loads(text)


# JSON Schema's numeric bounds. FastAPI's OpenAPI models hold them as floats: 0 comes out as 0.0,
# and an integer bound past 2^53 rounded (2^63 - 1 would read as 2^63).
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _integer_bounds(node: Any) -> None:
    """Every whole-number bound written as a JSON integer again, in place (the
    request models' integer bounds are all exact as doubles, see ``protocol._SEED``)."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                _integer_bounds(value)


def _operations(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [operation for path in schema.get("paths", {}).values() for operation in path.values()]


def _document_server_rules(schema: dict[str, Any], state: ServerState) -> None:
    """Narrow the request schemas to what this server takes, in place:
    - ``model``: one of the served names, without LoRA (with ``--enable-lora``
      adapters come and go while the server runs, so any name is documented
      and one not served is the documented 404);
    - unless ``--trust-request-chat-template``: no ``chat_template``, ``tools``
      only if the server's template renders them (and so ``tool_choice`` other
      than "none" only then), and only the ``chat_template_kwargs`` its template
      reads (``render_chat``'s checks); the same ``tools`` rule always for the
      Responses and Messages requests, which run on the server's template;
    - ``suffix`` only with a tokenizer that has fill-in-the-middle tokens."""
    components = schema.get("components", {}).get("schemas", {})
    tokenizer = state.engine_info.tokenizer
    if state.adapters is None:
        for name in MODEL_CHECKED_SCHEMAS:
            _narrow(components.get(name), {"model": _served_names(components.get(name), state.model_names)})
    if not state.chat.trust_request_chat_template:
        rules: dict[str, Any] = {"chat_template": {
            "type": "null", "description": "this server runs its own template only (--trust-request-chat-template "
                                          "lets requests send theirs)"}}
        if state.chat.chat_template or tokenizer.chat_template:
            variables = state.template_variables()
            if "tools" not in variables:
                rules.update(_without_tools({"const": "none"}))
            takes = sorted(variables - rendering_arguments(tokenizer))
            names_rule = {"propertyNames": {"enum": takes}} if takes else {"maxProperties": 0}
            rules["chat_template_kwargs"] = {"anyOf": [{"type": "object", **names_rule}, {"type": "null"}],
                                             "description": "the variables this server's chat template reads"}
        for name, condition in CHAT_TEMPLATE_SCHEMAS.items():
            _narrow(components.get(name), rules, condition)
    if "tools" not in state.template_variables():
        for name, choice_none in OWN_TEMPLATE_TOOL_CHOICE_NONE.items():
            _narrow(components.get(name), _without_tools(choice_none))
    if fim_token_names(tokenizer) is None:
        _narrow(components.get("CompletionRequest"), {"suffix": {
            "type": "null", "description": "this model has no fill-in-the-middle tokens"}})


def _without_tools(tool_choice_none: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` of a request whose chat template renders no tools."""
    return {"tools": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
                      "description": "this server's chat template does not render tools"},
            "tool_choice": {"anyOf": [tool_choice_none, {"type": "null"}]}}


def _served_names(component: dict[str, Any] | None, names: list[str]) -> dict[str, Any]:
    """``model`` as one of ``names``; null too where the request model lets it be left out."""
    served = {"type": "string", "enum": list(names)}
    field = (component or {}).get("properties", {}).get("model", {})
    if {"type": "null"} not in field.get("anyOf", []):
        return {**served, "description": "one of the names this server serves (--served-model-name)"}
    return {"anyOf": [served, {"type": "null"}],
            "description": "one of the names this server serves (--served-model-name); null: the first"}


def _narrow(component: dict[str, Any] | None, fields: dict[str, Any], condition: dict[str, Any] | None = None) -> None:
    """Replace the schemas of ``component``'s ``fields`` that it has (those it lacks are left
    out); under ``condition``, add them as an ``if``/``then`` rule instead."""
    if component is None:
        return
    properties = component.get("properties", {})
    fields = {name: field for name, field in fields.items() if name in properties}
    if condition is None:
        for name, field in fields.items():
            properties[name] = {**field, "title": properties[name].get("title", name)}
    elif fields:
        component.setdefault("allOf", []).append({"if": condition, "then": {"properties": fields}})

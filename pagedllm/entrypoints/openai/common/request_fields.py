"""The request fields around the request models (``protocol``): those of OpenAI's
and vLLM's APIs that pagedllm does not implement (a 400 naming the field unless
it is sent at a value that asks for nothing, and documented so), unknown ones
(ignored and logged once per name, in a bounded log), and the rules between a
model's fields spelled as JSON Schema for the OpenAPI document (``schema_rules``)."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Mapping
from functools import cache
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from pagedllm.logger import init_logger

logger = init_logger("pagedllm.entrypoints.openai.common.protocol")

# Request fields of OpenAI's and vLLM's APIs that pagedllm does not implement,
# with the values that ask for nothing (None is always one): setting another
# value is a 400 naming the field. A route that implements one declares it as a
# field of its request model, which takes precedence over this list.
UNIMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # OpenAI chat
    "audio": (), "function_call": ("none",), "functions": ([],), "metadata": ({},), "modalities": (["text"],),
    "moderation": (), "prediction": (), "prompt_cache_key": (), "prompt_cache_options": (),
    "prompt_cache_retention": (), "reasoning_effort": (), "safety_identifier": (), "service_tier": ("auto",),
    "store": (False,), "verbosity": (), "web_search_options": (),
    # OpenAI completions fields the chat endpoint does not have (vLLM accepts echo there)
    "echo": (False,), "suffix": (),
    # vLLM's extras
    "use_beam_search": (False,), "length_penalty": (1.0,), "prompt_embeds": (), "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},), "logits_processors": ([],), "kv_transfer_params": (), "vllm_xargs": ({},),
    "guided_whitespace_pattern": (), "structural_tag": (), "documents": ([],),
    "add_special_tokens": (False,), "spaces_between_special_tokens": (True,), "request_id": (),
    "return_token_ids": (False,), "return_tokens_as_token_ids": (False,), "prompt_logprobs": (),
}
# What to use instead, where pagedllm has something close (appended to the 400's message).
UNIMPLEMENTED_FIELD_HINTS: dict[str, str] = {
    "guided_whitespace_pattern": "it is an outlines option; use structured_outputs.disable_any_whitespace "
                                 "for JSON without whitespace",
}


class IgnoredFieldLog:
    """Warns once per (request kind, field name) that an unknown field was
    ignored, so a client sending one every time does not flood the log. It
    remembers at most ``limit`` names (every name a fuzzer makes up would
    otherwise stay in memory for good); past that it says once that further
    unknown fields are not logged, and logs none."""

    def __init__(self, limit: int = 256, log: Any = None) -> None:
        self.limit = limit
        self._log = log or logger
        self._seen: set[tuple[str, str]] = set()
        self._full = False
        self._lock = threading.Lock()  # requests are validated on the event loop, but the offline API has threads

    def __call__(self, model_name: str, field_name: str) -> None:
        key = (model_name, field_name)
        with self._lock:
            if key in self._seen or self._full:
                return
            if len(self._seen) >= self.limit:
                self._full = True
                self._log.warning("%d unknown request fields were logged; further unknown fields are ignored "
                                  "without being logged", self.limit)
                return
            self._seen.add(key)
        # A made-up name may be long: the line shows its start.
        shown = field_name if len(field_name) <= 100 else field_name[:100] + "..."
        self._log.warning("%s: ignoring the unknown field %r", model_name, shown)


_log_ignored_field = IgnoredFieldLog()


def _unimplemented_field_error(model_name: str, field_name: str, value: Any) -> ValidationError:
    """A validation error located at the field, so the 400 names it in ``param``."""
    hint = UNIMPLEMENTED_FIELD_HINTS.get(field_name)
    error = PydanticCustomError(
        "unimplemented_field", "{field} is not implemented by pagedllm; leave it out or at its default" + (
            "; {hint}" if hint else ""),
        {"field": field_name, "hint": hint},
    )
    return ValidationError.from_exception_data(model_name, [InitErrorDetails(type=error, loc=(field_name,), input=value)])


def refuse_unimplemented_fields(model: type[BaseModel], unimplemented: Mapping[str, tuple[Any, ...]],
                               data: Any) -> Any:
    """A request model's before-validator: 400 for a field of ``unimplemented`` set to
    something else than a value that asks for nothing; log unknown fields once."""
    if not isinstance(data, dict):
        return data
    for name, value in data.items():
        if name in model.model_fields:
            continue
        if name in unimplemented:
            if value is not None and not any(_json_equal(value, harmless) for harmless in unimplemented[name]):
                # Raised as a ValidationError (pydantic passes it through) so the error carries the field's location.
                raise _unimplemented_field_error(model.__name__, name, value)
        else:
            _log_ignored_field(model.__name__, name)
    return data


def _json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON values (as a JSON Schema ``const`` compares): 1 and 1.0 are, False and 0 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[key], b[key]) for key in a)
    return type(a) is type(b) and a == b


def unimplemented_field_schemas(model: type[BaseModel], unimplemented: Mapping[str, tuple[Any, ...]]
                                ) -> dict[str, dict[str, Any]]:
    """JSON Schema of the fields ``refuse_unimplemented_fields`` refuses, for the
    OpenAPI document: each takes only null and the values that ask for nothing."""
    return {name: {"anyOf": [{"type": "null"}, *({"const": value} for value in values)],
                   "description": "not implemented by pagedllm: leave it out or at its default"}
            for name, values in unimplemented.items() if name not in model.model_fields}


def set_field(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema: ``field`` is present and matches ``schema``."""
    return {"required": [field], "properties": {field: schema}}


def one_of_cases(*cases: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema: the request is one of these cases. A rule between fields is
    spelled as the cases it allows (not as ``if``/``then``, which schemathesis
    expands into a branch per rule and gives up on past a few rules)."""
    return {"anyOf": list(cases)}


def schema_rules(*rules: dict[str, Any]) -> Callable[[dict[str, Any], type[BaseModel]], None]:
    """A model's ``json_schema_extra``: the rules between its fields, as JSON Schema
    (``allOf`` of ``anyOf`` cases), so the OpenAPI document states what the server
    checks in code (each rule names the check it states); and the fields it
    refuses as unimplemented (``unimplemented_fields``), with the values it takes."""

    def extra(schema: dict[str, Any], model: type[BaseModel]) -> None:
        if rules:
            schema.setdefault("allOf", []).extend(rules)
        unimplemented = getattr(model, "unimplemented_fields", None)
        if unimplemented:
            schema.setdefault("properties", {}).update(unimplemented_field_schemas(model, unimplemented))

    return extra


def _whole_numbers_as_int(annotation: Any, value: Any) -> Any:
    """``value`` with each whole-number float where ``annotation`` has an ``int``
    made that int (``197.0`` -> ``197``); anything else as it was."""
    origin = get_origin(annotation)
    if annotation is int:
        return int(value) if type(value) is float and value.is_integer() else value
    if origin is Annotated:
        return _whole_numbers_as_int(get_args(annotation)[0], value)
    if origin is Union or origin is types.UnionType:
        for branch in get_args(annotation):
            value = _whole_numbers_as_int(branch, value)
        return value
    if origin is list and isinstance(value, list):
        return [_whole_numbers_as_int(get_args(annotation)[0], item) for item in value]
    if origin is dict and isinstance(value, dict):
        return {key: _whole_numbers_as_int(get_args(annotation)[1], item) for key, item in value.items()}
    return value


@cache
def _integer_fields(model: type[BaseModel]) -> tuple[tuple[str, Any], ...]:
    """(JSON key, annotation) of ``model``'s fields whose type holds an ``int``
    (a nested request object does its own)."""
    def holds_int(annotation: Any) -> bool:
        return annotation is int or any(holds_int(arg) for arg in get_args(annotation))

    return tuple((field.alias or name, field.annotation) for name, field in model.model_fields.items()
                 if holds_int(field.annotation))


class StrictModel(BaseModel):
    """A request object: no coercion between JSON types (a bool or ``"1"`` is
    not an integer, ``1`` no boolean), as the OpenAPI document's types say;
    but a whole-number float is an integer (``197.0``), as JSON Schema counts
    it and as vLLM (pydantic's lax mode) parses it. ``197.5`` stays a 400
    naming the field."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers_are_integers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = [(key, annotation) for key, annotation in _integer_fields(cls) if key in data]
        if not fields:
            return data
        data = dict(data)  # the caller's body stays as it was sent
        for key, annotation in fields:
            data[key] = _whole_numbers_as_int(annotation, data[key])
        return data


class FieldCheckedModel(StrictModel):
    """A request body that refuses the fields of ``unimplemented_fields`` (a subclass gives its own
    table, or other harmless values) and logs unknown ones (``refuse_unimplemented_fields``)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=schema_rules())
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = UNIMPLEMENTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented_fields(cls, data: Any) -> Any:
        return refuse_unimplemented_fields(cls, cls.unimplemented_fields, data)

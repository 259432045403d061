"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Field names follow OpenAI plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``cache_salt``,
``priority``, ...). A known field of the wrong type is a 400: types are strict
(``StrictModel``), so ``true`` or ``"1"`` is no integer and ``1`` no boolean; a
whole-number float (``1.0``) is an integer, as JSON Schema and vLLM count it.
The bounds that do not depend on the engine are ``Field`` constraints here (in
the OpenAPI document too), and so are the rules between fields, as JSON Schema
in each model's ``json_schema_extra`` (``request_fields.schema_rules``) beside the code that
checks them; those from the engine's limits are in ``limits``, those from the
server's settings in ``openapi_doc``. Nothing is dropped
silently: a field of OpenAI's or vLLM's API that pagedllm does not implement is a
400 naming it (``request_fields.UNIMPLEMENTED_FIELDS``) unless it has its harmless
default, and a truly unknown field is ignored and logged once per name, as vLLM does
(up to ``IgnoredFieldLog.limit`` names per process: fuzzed names must not grow memory).
A chat request's messages and tools are in ``chat.protocol``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import ConfigDict, Field, WithJsonSchema

from pagedllm.entrypoints.openai.common.errors import RequestFieldError
# Re-exported: the other front doors' request models share them.
from pagedllm.entrypoints.openai.chat.protocol import (  # noqa: F401
    _FUNCTION_NAME, AssistantMessage, ChatMessage, ChatTool, FunctionCall, FunctionDefinition, NamedFunction,
    NamedToolChoice, PlainMessage, TextPart, ToolCall, ToolMessage,
)
from pagedllm.entrypoints.openai.common.request_fields import (  # noqa: F401
    UNIMPLEMENTED_FIELD_HINTS, UNIMPLEMENTED_FIELDS, FieldCheckedModel, IgnoredFieldLog, StrictModel, one_of_cases,
    refuse_unimplemented_fields, schema_rules, set_field,
)
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# Integer fields without a bound of their own stay in 64 bits, which the engine core's wire (msgpack)
# carries, up to the largest integer below 2^63 that a double holds exactly: JSON tools that read
# numbers as doubles (schemathesis's validator among them) then agree with the server on which
# values are in range (2^63 - 1 reads as 2^63).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1024
# A 64-bit seed (torch.Generator's range, as vLLM bounds it).
_SEED = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
# A top_k at least the vocabulary filters nothing, so any larger one is taken as this (which
# the core's wire carries; a vocabulary is far smaller).
_NO_TOP_K = 2**31 - 1
TokenId = Annotated[int, Field(ge=0)]  # the vocabulary's size is the maximum (``limits``)
# logit_bias keys: JSON object keys are strings, a token id in decimal (``sampling_params`` makes them
# integers; ``limits`` bounds them by the vocabulary, in the 400s and in the document's pattern).
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# A string that is not all whitespace, as Python's str.strip() sees it (SamplingParams' rule for bad_words):
# a character outside every whitespace character Python knows, spelled as \uXXXX so that JSON Schema's
# regular expressions, Rust's (pydantic) and Python's read the class alike.
_PY_WHITESPACE = "".join(f"\\u{ord(c):04x}" for c in map(chr, range(0x110000)) if c.isspace())
NonBlankStr = Annotated[str, Field(pattern=f"[^{_PY_WHITESPACE}]")]
# pydantic documents a dict of constrained keys as patternProperties, which admits any other key too.
_LOGIT_BIAS = {"type": "object", "propertyNames": {"pattern": r"^(0|[1-9][0-9]*)$"},
               "additionalProperties": {"type": "number"}}
T = TypeVar("T")
NonEmptyList = Annotated[list[T], Field(min_length=1)]


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """OpenAI's ``response_format.json_schema``. The schema is always enforced
    exactly (``strict`` is accepted; false does not loosen anything)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    # _constraint_of: a json_schema format needs its schema.
    model_config = ConfigDict(extra="forbid", json_schema_extra=schema_rules(one_of_cases(
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        set_field("json_schema", {"type": "object", **set_field("schema", {"type": "object"})}))))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The kinds of constraint of a structured_outputs object, and what each looks like when it is set
# (StructuredOutputsParams counts json_object: false as not set). Not set: null, json_object false.
_CONSTRAINT_KINDS = {"json": {"type": ["string", "object"]}, "json_object": {"const": True},
                     "regex": {"type": "string"}, "choice": {"type": "array"}, "grammar": {"type": "string"}}
_NULL = {"type": "null"}


def _one_kind(kind: str) -> dict[str, Any]:
    others = {other: {"anyOf": [_NULL, {"const": False}]} if other == "json_object" else _NULL
              for other in _CONSTRAINT_KINDS if other != kind}
    return {"required": [kind], "properties": {kind: _CONSTRAINT_KINDS[kind], **others}}


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs`` object: exactly one constraint."""

    # StructuredOutputsParams' check: exactly one kind set.
    model_config = ConfigDict(extra="forbid", json_schema_extra=schema_rules(
        {"anyOf": [_one_kind(kind) for kind in _CONSTRAINT_KINDS]}))

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: NonEmptyList[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


# The request fields that constrain the output, in the order they are reported.
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar")
GUIDED_DECODING_BACKENDS = ("xgrammar", "auto")
# What each of them looks like when it constrains the output (response_format "text" does not).
_CONSTRAINING = {"response_format": {"type": "object", "required": ["type"],
                                     "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
                 "structured_outputs": {"type": "object"}, "guided_json": {"type": ["string", "object"]},
                 "guided_regex": {"type": "string"}, "guided_choice": {"type": "array"},
                 "guided_grammar": {"type": "string"}}


def _unconstrained(*also: str) -> dict[str, Any]:
    """JSON Schema properties: no field of STRUCTURED_OUTPUT_FIELDS but ``also`` constrains the
    output (each is null, or response_format a plain "text" one)."""
    text = {"type": "object", "properties": {"type": {"const": "text"}}}
    return {name: {"anyOf": [_NULL, text]} if name == "response_format" else _NULL
            for name in _CONSTRAINING if name not in also}


# What a grammar needs beside it: it decides where the output ends (StructuredOutputManager.compile).
_GRAMMAR_ENDS = {"ignore_eos": {"const": False}, "min_tokens": {"const": 0}}
# structured_output_field and the grammar's own check: one constraint at a time, and none beside
# ignore_eos or min_tokens. Said in words on each field: as JSON Schema it is 7 cases, which,
# multiplied by a request's other rules and its ~80 documented fields, takes schemathesis's
# generator past what it models (tests/entrypoints/schemathesis_hooks.py keeps fuzzed requests to it).
_ONE_CONSTRAINT = Field(default=None, description=(
    "constrains the output: a request sets at most one of response_format (json_object or json_schema), "
    "structured_outputs, guided_json, guided_regex, guided_choice and guided_grammar, and none of them "
    "with ignore_eos or min_tokens > 0 (else a 400 names the field)"))


class _SamplingFields(FieldCheckedModel):
    # (A request model overrides unimplemented_fields to give a field another harmless value.)
    model: str | None = None
    n: int = Field(default=1, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: int | None = _SEED
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)  # at least the vocabulary: no top-k (``_NO_TOP_K``)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: NonEmptyStr | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # OpenAI's logit_bias (JSON keys are strings: token ids in decimal) and vLLM's token rules
    logit_bias: Annotated[dict[TokenIdKey, float], WithJsonSchema(_LOGIT_BIAS)] | None = None
    allowed_token_ids: NonEmptyList[TokenId] | None = None
    bad_words: list[NonBlankStr] | None = None
    # -1: as many as the context allows
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None
    # Structured output (guided decoding): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields; at most one.
    response_format: ResponseFormat | None = _ONE_CONSTRAINT
    structured_outputs: StructuredOutputsRequest | None = _ONE_CONSTRAINT
    guided_json: str | dict[str, Any] | None = _ONE_CONSTRAINT
    guided_regex: str | None = _ONE_CONSTRAINT
    guided_choice: NonEmptyList[str] | None = _ONE_CONSTRAINT
    guided_grammar: str | None = _ONE_CONSTRAINT
    guided_decoding_backend: Literal[GUIDED_DECODING_BACKENDS] | None = None  # this server has xgrammar

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None, *,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Raises ``ValueError`` (naming the field) for out-of-range values.
        ``defaults`` (the engine's, from generation_config.json) fill the
        fields the request left unset, max_tokens included."""
        defaults = defaults or {}
        if not self.model_fields_set & {"max_tokens", "max_completion_tokens"}:
            max_tokens = defaults.get("max_tokens", max_tokens)
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            temperature=defaults.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=defaults.get("top_k", 0) if self.top_k is None else min(self.top_k, _NO_TOP_K),
            min_p=defaults.get("min_p", 0.0) if self.min_p is None else self.min_p,
            repetition_penalty=(defaults.get("repetition_penalty", 1.0) if self.repetition_penalty is None
                                else self.repetition_penalty),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
        )

    def structured_output_field(self) -> str | None:
        """The request field that constrains the output, or None. Raises
        ``RequestFieldError`` when several do."""
        fields = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            fields.remove("response_format")  # plain text: no constraint
        if len(fields) > 1:
            raise RequestFieldError(fields[1], f"{' and '.join(fields)} each constrain the output; send only one")
        return fields[0] if fields else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint of this request (``ValueError`` naming the field if it is malformed)."""
        field = self.structured_output_field()
        if field is None:
            return None
        try:
            return self._constraint_of(field)
        except RequestFieldError:
            raise
        except ValueError as exc:  # StructuredOutputsParams' own check (one constraint, a non-empty choice)
            raise RequestFieldError(field, f"{field}: {exc}") from exc

    def _constraint_of(self, field: str) -> StructuredOutputsParams:
        if field == "response_format":
            response_format = self.response_format
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise RequestFieldError("response_format",
                                        "response_format of type json_schema needs json_schema.schema (a JSON schema)")
            return StructuredOutputsParams(json=response_format.json_schema.schema_)
        if field == "structured_outputs":
            fields = self.structured_outputs
            return StructuredOutputsParams(json=fields.json_, json_object=fields.json_object, regex=fields.regex,
                                           choice=fields.choice, grammar=fields.grammar,
                                           disable_any_whitespace=fields.disable_any_whitespace)
        kind = field.removeprefix("guided_")
        return StructuredOutputsParams(**{kind: getattr(self, field)})


_NOT_ZERO = {"anyOf": [_NULL, {"type": "integer", "minimum": 1}]}


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=schema_rules(
        # completions.serving: max_tokens 0 only with echo (which it then returns alone); suffix not with echo.
        one_of_cases({"properties": {"max_tokens": _NOT_ZERO, "echo": {"const": False}}},
                      {"properties": {"max_tokens": _NOT_ZERO, "suffix": {"type": "null"}}},
                      {"required": ["echo"],
                       "properties": {"max_tokens": {"const": 0}, "echo": {"const": True}, "suffix": {"type": "null"}}}),
    ))
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = {**UNIMPLEMENTED_FIELDS, "add_special_tokens": (True,)}

    prompt: NonEmptyStr | NonEmptyList[NonEmptyStr] | NonEmptyList[TokenId] | NonEmptyList[NonEmptyList[TokenId]]
    # 0 only with echo: the prompt comes back and nothing is generated.
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    # Fill-in-the-middle: the text after the completion (needs a model with FIM tokens).
    suffix: str | None = None
    # vLLM's extras: prompt logprobs per choice, and tokens shown as "token_id:<id>" in logprobs.
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_tokens_as_token_ids: bool = False


# render_chat: continue_final_message continues the last message, so no generation prompt is added.
_CONTINUE_RULE = one_of_cases({"properties": {"continue_final_message": {"const": False}}},
                               set_field("add_generation_prompt", {"const": False}))


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=schema_rules(
        # prepare_chat: top_logprobs needs logprobs.
        one_of_cases({"properties": {"top_logprobs": {"type": "null"}}}, set_field("logprobs", {"const": True})),
        # continue_final_message's other rule, the last message being the assistant's, is beyond JSON
        # Schema (tests/entrypoints/schemathesis_hooks.py keeps fuzzed requests to it).
        _CONTINUE_RULE,
        # plan_tool_choice: a tool choice other than "none" needs tools; a required or named one
        # constrains the output itself (_with_tool_grammar), so no other constraint beside it.
        one_of_cases(
            {"properties": {"tool_choice": {"anyOf": [{"const": "none"}, {"type": "null"}]}}},
            {"required": ["tool_choice", "tools"],
             "properties": {"tool_choice": {"const": "auto"}, "tools": {"type": "array", "minItems": 1}}},
            {"required": ["tool_choice", "tools"],
             "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]},
                            "tools": {"type": "array", "minItems": 1}, **_unconstrained(), **_GRAMMAR_ENDS}}),
    ))

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # Tools and chat templates (pagedllm/entrypoints/chat_utils.py, openai/tool_parsers/)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: false leaves the thinking out of the answer (under --reasoning-parser; without one there is none)
    include_reasoning: bool = True


class TokenizeRequest(StrictModel):
    # The route: a prompt or messages (messages win); with messages, render_chat's rule.
    model_config = ConfigDict(json_schema_extra=schema_rules(
        one_of_cases(set_field("prompt", {"type": "string"}), set_field("messages", {"type": "array"})),
        one_of_cases({"properties": {"messages": {"type": "null"}}}, _CONTINUE_RULE),
    ))

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    # With messages: the chat request's template fields, so the count matches its prompt.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[TokenId]

"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Field names follow OpenAI plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``cache_salt``,
``priority``, ...). A known field of the wrong type is a 400. Nothing is dropped
silently: a field of OpenAI's or vLLM's API that pagedllm does not implement is a
400 naming it (``UNIMPLEMENTED_FIELDS``) unless it has its harmless default, and a
truly unknown field is ignored and logged once per name, as vLLM does.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from pagedllm.entrypoints.openai.errors import RequestFieldError
from pagedllm.logger import init_logger
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = init_logger(__name__)

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
    "guided_whitespace_pattern": (), "structural_tag": (), "documents": ([],), "include_reasoning": (True,),
    "add_special_tokens": (False,), "spaces_between_special_tokens": (True,), "request_id": (),
    "return_token_ids": (False,), "return_tokens_as_token_ids": (False,), "prompt_logprobs": (),
}
# What to use instead, where pagedllm has something close (appended to the 400's message).
UNIMPLEMENTED_FIELD_HINTS: dict[str, str] = {
    "guided_whitespace_pattern": "it is an outlines option; use structured_outputs.disable_any_whitespace "
                                 "for JSON without whitespace",
}


@functools.cache
def _log_ignored_field(model_name: str, field_name: str) -> None:
    """Warn once per (request kind, field name): a client sending a field every
    time must not flood the log."""
    logger.warning("%s: ignoring the unknown field %r", model_name, field_name)


def _unimplemented_field_error(model_name: str, field_name: str, value: Any) -> ValidationError:
    """A validation error located at the field, so the 400 names it in ``param``."""
    hint = UNIMPLEMENTED_FIELD_HINTS.get(field_name)
    error = PydanticCustomError(
        "unimplemented_field", "{field} is not implemented by pagedllm; leave it out or at its default" + (
            "; {hint}" if hint else ""),
        {"field": field_name, "hint": hint},
    )
    return ValidationError.from_exception_data(model_name, [InitErrorDetails(type=error, loc=(field_name,), input=value)])


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``. The schema is always enforced
    exactly (``strict`` is accepted; false does not loosen anything)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


# The request fields that constrain the output, in the order they are reported.
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar")
GUIDED_DECODING_BACKENDS = ("xgrammar", "auto")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # A request model overrides this to give a field another harmless value.
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = UNIMPLEMENTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented_fields(cls, data: Any) -> Any:
        """400 for an unimplemented known field set to something; log unknown ones once."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in cls.model_fields:
                continue
            if name in cls.unimplemented_fields:
                if value is not None and value not in cls.unimplemented_fields[name]:
                    # Raised as a ValidationError (pydantic passes it through) so the error carries the field's location.
                    raise _unimplemented_field_error(cls.__name__, name, value)
            else:
                _log_ignored_field(cls.__name__, name)
        return data

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    # OpenAI's logit_bias (JSON keys are strings: pydantic makes them token ids) and vLLM's token rules
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Structured output (guided decoding): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields; at most one.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None, *,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
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
            top_k=defaults.get("top_k", 0) if self.top_k is None else self.top_k,
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
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
        )

    def structured_output_field(self) -> str | None:
        """The request field that constrains the output, or None. Raises
        ``RequestFieldError`` when several do, or for a backend this server lacks."""
        fields = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            fields.remove("response_format")  # plain text: no constraint
        if len(fields) > 1:
            raise RequestFieldError(fields[1], f"{' and '.join(fields)} each constrain the output; send only one")
        backend = self.guided_decoding_backend
        if backend is not None and backend not in GUIDED_DECODING_BACKENDS:
            raise RequestFieldError("guided_decoding_backend",
                                    f"guided_decoding_backend {backend!r} is not available; this server uses "
                                    f"xgrammar (send one of {list(GUIDED_DECODING_BACKENDS)} or omit it)")
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


class CompletionRequest(_SamplingFields):
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = {**UNIMPLEMENTED_FIELDS, "add_special_tokens": (True,)}

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: the prompt comes back and nothing is generated.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # Fill-in-the-middle: the text after the completion (needs a model with FIM tokens).
    suffix: str | None = None
    # vLLM's extras: prompt logprobs per choice, and tokens shown as "token_id:<id>" in logprobs.
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False


# OpenAI's rule for function names.
_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is taken as is


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message as the client sends it; ``chat_utils.conversation_for_template``
    checks its content and turns it into what the chat template reads."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a role "tool" message answers


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Tools and chat templates (pagedllm/entrypoints/chat_utils.py, openai/tool_parsers/)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # With messages: the chat request's template fields, so the count matches its prompt.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]

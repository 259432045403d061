"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Field names follow OpenAI plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``cache_salt``,
``priority``, ...). Unknown fields are ignored, as vLLM does; a known field of
the wrong type is a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestFieldError(ValueError):
    """A bad value in the request field ``param`` (the server's 400 names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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
    # Structured output (guided decoding): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields; at most one.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ``ValueError`` (naming the field) for out-of-range values."""
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
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
            structured_outputs=self.structured_outputs_params(),
        )

    def structured_output_field(self) -> str | None:
        """The request field that constrains the output, or None. Raises
        ``RequestFieldError`` when several do, or for a backend or option this server lacks."""
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
        if self.guided_whitespace_pattern is not None:
            raise RequestFieldError("guided_whitespace_pattern",
                                    "guided_whitespace_pattern is not supported (an outlines option); use "
                                    "structured_outputs.disable_any_whitespace for JSON without whitespace")
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
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain content, or the text parts of a content list joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]

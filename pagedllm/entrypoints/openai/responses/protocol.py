"""The request body of the Responses API (``POST /v1/responses``), pydantic.

The conventions of ``protocol``: strict types (no coercion between JSON types),
the bounds that need no engine as ``Field`` constraints (in the OpenAPI document
too), an unknown field ignored and logged once per name, and a field of
OpenAI's that pagedllm does not implement a 400 naming it unless it carries its
harmless default (``UNIMPLEMENTED_RESPONSES_FIELDS``). What the server refuses
inside a field the schema states as well: tools are function tools only (a
built-in tool such as web_search is a 400 naming ``tools``), and ``reasoning``
takes no options (the model thinks as its chat template says).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from pagedllm.entrypoints.openai.common.protocol import (_FUNCTION_NAME, NonEmptyStr, StrictModel,
                                                  refuse_unimplemented_fields)

# Fields of OpenAI's Responses API that pagedllm does not implement, with the
# values that ask for nothing (None is always one): another value is a 400.
UNIMPLEMENTED_RESPONSES_FIELDS: dict[str, tuple[Any, ...]] = {
    "background": (False,), "background_options": (), "conversation": (), "include": ([],),
    "max_tool_calls": (), "prompt": (), "top_logprobs": (0,), "truncation": ("disabled",),
    "service_tier": ("auto", "default"), "prompt_cache_retention": (), "prompt_cache_options": (),
    "context_management": ([],), "stream_options": ({}, {"include_obfuscation": False}),
    "access_programs": (), "image": (), "moderation": (),
}


def field_error(location: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A 400 located at ``location`` (its ``param``) saying ``message``."""
    error = PydanticCustomError("unsupported_value", "{message}", {"message": message})
    return ValidationError.from_exception_data("ResponsesRequest", [
        InitErrorDetails(type=error, loc=location, input=value)])


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """An earlier answer's text, as an output gave it (its annotations and logprobs are not read)."""

    type: Literal["output_text"]
    text: str


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(StrictModel):
    """An image for a vision-language model, by URL (a data URL, or one the server's media rules allow)."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted as OpenAI's; the processor decides the size


ContentPart = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]
ToolOutputPart = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(StrictModel):
    """A message; its ``id`` and ``status`` (an earlier output's) are not read."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(StrictModel):
    """A call an earlier output made (``call_id`` pairs it with its ``function_call_output``)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # a JSON object, as the output gave it


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[ToolOutputPart]


class ReasoningItem(StrictModel):
    """Thinking of an earlier output: accepted and left out of the prompt, as chat
    templates drop earlier turns' thinking."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    """A message may leave out its ``type``."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


def _not_only_reasoning(items: list[Any]) -> list[Any]:
    if all(isinstance(item, ReasoningItem) for item in items):
        raise ValueError("an input list needs an item other than reasoning (a message, a function call or its output)")
    return items


# Reasoning items are dropped from the prompt: a list of nothing else would leave no conversation.
InputItems = Annotated[list[InputItem], Field(min_length=1, json_schema_extra={"contains": {"not": {
    "type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}}}}),
    AfterValidator(_not_only_reasoning)]


class FunctionTool(StrictModel):
    """A function tool (the only kind pagedllm runs: the client runs the function)."""

    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    """The output follows ``schema``; it is always enforced exactly (``strict`` false loosens nothing)."""

    type: Literal["json_schema"]
    name: str = Field(pattern=_FUNCTION_NAME)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(default=None, description="only OpenAI's default: pagedllm does "
                                                                          "not steer the answer's length")


class ReasoningOptions(StrictModel):
    """Accepted without options only: the model thinks as its chat template says,
    and with --reasoning-parser its thinking comes back as a reasoning item."""

    model_config = ConfigDict(json_schema_extra={"additionalProperties": {"type": "null"}})  # any other, null too

    effort: None = None
    summary: None = None
    generate_summary: None = None


Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


def _rules(schema: dict[str, Any]) -> None:
    """The rules between fields, as JSON Schema: plan_tool_choice's, a required or named
    tool choice needs tools (OpenAI's "auto" without tools means none, as there)."""
    forced = {"anyOf": [{"const": "required"}, {"type": "object"}]}
    schema.setdefault("allOf", []).append({
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": forced}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}})


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``: run on the chat path (``responses_input.to_chat_request``)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_rules)
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = UNIMPLEMENTED_RESPONSES_FIELDS

    model: str | None = None
    input: str | InputItems
    instructions: str | None = None  # a system message first (not carried over by previous_response_id)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    reasoning: ReasoningOptions | None = None
    # Echoed back in the Response, as OpenAI does; pagedllm reads nothing from them.
    metadata: Metadata | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        """400 for an unimplemented field set to something, a built-in tool or a
        reasoning option (each naming what to change); log unknown fields once."""
        data = refuse_unimplemented_fields(cls, cls.unimplemented_fields, data)
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise field_error(("tools", i), f"the built-in tool {kind!r} is not supported by "
                                                "pagedllm; only function tools ({\"type\": \"function\", \"name\", "
                                                "\"parameters\"}), which the client runs", tool)
        reasoning = data.get("reasoning")
        for key, value in (reasoning.items() if isinstance(reasoning, dict) else ()):
            if value is not None:
                raise field_error(("reasoning", key), "not implemented by pagedllm: the model "
                                                      "thinks as its chat template says; leave it out or null", value)
        return data

    @property
    def stored(self) -> bool:
        return self.store is not False

"""Request and response bodies of the Anthropic Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``), as pydantic models.

Types are strict as in ``protocol`` (no coercion between JSON types). The rules
the server enforces are stated here, so the OpenAPI document says them: which
content blocks each role may send (text, ``tool_use``, ``tool_result``,
``thinking`` passed back), custom tools only, ``max_tokens`` required as
Anthropic requires. What a text model cannot do is a 400 naming it: image and
document blocks, Anthropic's server tools (``web_search_20250305``, ...), and
the API's fields pagedllm does not implement (``MESSAGES_UNIMPLEMENTED_FIELDS``).
A truly unknown field is ignored and logged, as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.entrypoints.openai.common.protocol import NonEmptyStr, StrictModel, refuse_unimplemented_fields

# Fields of Anthropic's Messages API that pagedllm does not implement, with the values
# that ask for nothing (None always does): any other value is a 400 naming the field.
MESSAGES_UNIMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "container": (), "context_management": (), "mcp_servers": ([],), "inference_geo": (), "speed": ("standard",),
    "diagnostics": (), "compaction": (), "fallbacks": (), "thread": (),
    # Capacity tiers: this server has one, so both values ask for what it does.
    "service_tier": ("auto", "standard_only"),
}
# Content block types a text model cannot read (a 400 names the block instead of dropping it).
UNSUPPORTED_BLOCK_TYPES = frozenset({
    "document", "search_result", "container_upload", "server_tool_use", "web_search_tool_result",
    "web_fetch_tool_result", "code_execution_tool_result", "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result", "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result",
})
# Anthropic's rule for tool names (the same as OpenAI's for functions, so chat takes them as they are).
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class CacheControl(StrictModel):
    """A prompt-cache breakpoint. Accepted and not needed: the prefix cache keeps every
    full block of every prompt by itself (``usage.cache_read_input_tokens`` reports its hits)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # A response's text blocks passed back carry their citations; this server makes none and renders none.
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(StrictModel):
    """A call the assistant made (a turn passed back): chat's ``tool_calls``."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
    """The answer to a ``tool_use`` (in a user turn): chat's ``tool`` message."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] | None = None
    is_error: bool = False  # rendered as "Error: " before the content, so the model reads it
    cache_control: CacheControl | None = None


class ThinkingBlock(StrictModel):
    """Thinking passed back from an earlier response: not rendered (the chat
    templates of reasoning models drop earlier turns' thinking too)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(StrictModel):
    type: Literal["url"]
    url: str  # fetched by the server's media rules (--allowed-media-domains, --allowed-local-media-path)


class ImageBlock(StrictModel):
    """An image for a vision-language model (a text-only model answers 400)."""

    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        source = self.source
        return source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type")]


def _refuse_unsupported_blocks(data: Any) -> Any:
    """A 400 naming an image, document or server-tool block (a text model cannot read it)."""
    content = data.get("content") if isinstance(data, dict) else None
    if not isinstance(content, list):
        return data
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        inner = block.get("content") if block.get("type") == "tool_result" else None
        nested = [(f"content[{j}].content[{k}]", part) for k, part in enumerate(inner)
                  if isinstance(part, dict)] if isinstance(inner, list) else []
        for where, part in [(f"content[{j}]", block), *nested]:
            kind = part.get("type")
            if isinstance(kind, str) and kind in UNSUPPORTED_BLOCK_TYPES:
                raise PydanticCustomError(
                    "unsupported_block", "{where}: {kind} blocks are not supported by pagedllm, which serves a "
                    "text model; send the content as text", {"where": where, "kind": kind})
    return data


class _Message(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported_blocks(data)


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(_Message):
    """An earlier assistant turn; as the last message, the start of the answer to continue."""

    role: Literal["assistant"]
    content: str | list[AssistantBlock]


MessageParam = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class InputSchema(StrictModel):
    """A tool's input: a JSON schema of an object (further JSON Schema keywords are kept)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["object"]
    properties: dict[str, Any] | None = None
    required: list[str] | None = None


class ToolDefinition(StrictModel):
    """A custom (client) tool; Anthropic's server tools are a 400 naming them."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: InputSchema
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_server_tools(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise PydanticCustomError(
                "server_tool", "the tool type '{kind}' is one of Anthropic's server tools, which pagedllm does "
                "not run; define a custom tool (name, description, input_schema) and run it yourself",
                {"kind": kind})
        return data


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class ThinkingEnabled(StrictModel):
    """Thinking on. ``budget_tokens`` is checked as Anthropic checks it but not
    enforced: the thinking and the answer share ``max_tokens``."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted"] | None = None  # omitted: no thinking blocks in the answer


class ThinkingAdaptive(StrictModel):
    """The model decides: as ``enabled`` here (a chat template's switch can only turn thinking on)."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    """``format``: the answer is JSON matching the schema (a grammar enforces it)."""

    format: JsonOutputFormat | None = None
    effort: None = Field(default=None, description="not implemented by pagedllm: leave it out")

    @model_validator(mode="before")
    @classmethod
    def _refuse_effort(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("effort") is not None:
            raise PydanticCustomError("unimplemented_field", "output_config.effort is not implemented by pagedllm; "
                                      "leave it out")
        return data


class Metadata(StrictModel):
    user_id: str | None = None  # passed on as chat's ``user``


def _object_with(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema: an object whose ``field`` is present and matches ``schema``."""
    return {"type": "object", "required": [field], "properties": {field: schema}}


# The rules between fields that chat's checks apply (``plan_tool_choice``, ``_with_tool_grammar``), as JSON Schema.
_FORCING = _object_with("type", {"enum": ["any", "tool"]})
_FIELD_RULES = [
    # A tool choice other than none needs tools to choose from.
    {"if": _object_with("tool_choice", _object_with("type", {"enum": ["auto", "any", "tool"]})),
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    # A forced tool call and an output format each constrain the output with a grammar: one at a time.
    {"if": _object_with("output_config", _object_with("format", {"type": "object"})),
     "then": {"properties": {"tool_choice": {"not": _FORCING}}}},
]


class MessagesCountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: the prompt a Messages request would run."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": _FIELD_RULES})
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = MESSAGES_UNIMPLEMENTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented_fields(cls, data: Any) -> Any:
        return refuse_unimplemented_fields(cls, cls.unimplemented_fields, data)

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(MessagesCountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None


# The response bodies, for the OpenAPI document (the routes build plain dicts of these shapes).

class TextOut(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str  # always "": nothing signs this server's thinking


class ToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    """Anthropic's split: ``input_tokens`` + ``cache_read_input_tokens`` is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int  # the prompt's tokens found in the prefix cache
    cache_creation_input_tokens: int  # always 0: caching costs nothing extra here


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Annotated[ThinkingOut | TextOut | ToolUseOut, Field(discriminator="type")]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                  "request_too_large", "rate_limit_error", "api_error", "overloaded_error"]
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Messages routes, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail

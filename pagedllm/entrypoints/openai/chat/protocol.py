"""The parts of a chat request (``protocol.ChatCompletionRequest``): its messages,
one model per role, and its tools and tool choice."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.entrypoints.openai.common.request_fields import StrictModel

# OpenAI's rule for function names.
_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is taken as is


class ToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str  # data:image/...;base64,..., file:// (--allowed-local-media-path) or http(s) (--allowed-media-domains)
    detail: Literal["auto", "low", "high"] | None = None  # accepted as OpenAI's; the processor decides the size


class ImagePart(StrictModel):
    """An image for a vision-language model (a text-only model answers 400)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class _Message(StrictModel):
    """A message as the client sends it, one model per role (so the OpenAPI
    document states which fields each role takes); ``chat_utils.conversation_for_template``
    turns it into what the chat template reads."""

    model_config = ConfigDict(extra="ignore")

    content: str | list[ContentPart] | None = None
    name: str | None = None


class PlainMessage(_Message):
    role: Literal["system", "developer", "user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None  # its earlier calls


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str  # the call it answers


ChatMessage = Annotated[PlainMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction

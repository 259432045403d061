"""A Responses API request as the chat completion request it runs as: the one
chat path (rendering, tools, grammars, reasoning) serves both. Pure functions:
the fleet router can hash a Responses prompt with them, as a replica renders it.

Items become chat messages: a message keeps its role and its text; a
``function_call`` becomes an assistant ``tool_calls`` entry (joined to the
assistant message just before it, so an earlier turn reads as chat sent it); a
``function_call_output`` a ``tool`` message; a ``reasoning`` item is dropped, as
chat templates drop earlier turns' thinking. ``instructions`` is a system
message before everything, the stored conversation of ``previous_response_id``
included (OpenAI does not carry earlier instructions over).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.common.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.responses.protocol import (
    FunctionCallItem, FunctionCallOutputItem, FunctionToolChoice, InputImage, InputItem, MessageItem, Refusal,
    ResponsesRequest,
    TextFormatJsonObject, TextFormatJsonSchema,
)

_ITEMS = TypeAdapter(list[InputItem])
# A chat request field -> the Responses field a client sets instead (a 400's ``param``).
CHAT_TO_RESPONSES_FIELDS = {"messages": "input", "prompt": "input", "response_format": "text.format",
                            "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


def to_chat_request(body: ResponsesRequest, previous_messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``body`` after ``previous_messages`` (the stored conversation
    of its ``previous_response_id``; empty without one). Streaming asks for the usage chunk."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += previous_messages + input_messages(body)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user, "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice != "auto" or body.tools:  # OpenAI takes "auto" without tools: nothing to choose from
        fields["tool_choice"] = choice
    text_format = body.text.format if body.text is not None else None
    if body.tools and (choice == "required" or isinstance(choice, FunctionToolChoice)):
        # A forced call's output is the call, which text.format (a text answer's format) does not
        # govern: the Agents SDK sends both for an agent with an output type; chat refuses the pair.
        text_format = None
    if isinstance(text_format, TextFormatJsonSchema):
        fields["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            by_alias=True, exclude={"type"}, exclude_none=True)}
    elif isinstance(text_format, TextFormatJsonObject):
        fields["response_format"] = {"type": "json_object"}
    # Unset fields stay unset, so the engine's defaults (generation_config.json) apply as in chat.
    return ChatCompletionRequest.model_validate({name: value for name, value in fields.items() if value is not None})


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of the request's ``input`` (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return items_to_messages(body.input)


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Response's ``output`` items (the conversation a follow-up continues)."""
    return items_to_messages(_ITEMS.validate_python(output))


def items_to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of Responses items (``InputItem`` models), in order."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _json_text(item.arguments)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        # a ReasoningItem adds nothing
    return messages


def _json_text(arguments: str) -> str:
    """An earlier call's arguments as JSON text: ones that are not JSON (a call cut by
    max_output_tokens, stored so) are rendered as the string they are, not refused."""
    try:
        json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return json.dumps(arguments)
    return arguments


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """A message's content as chat content: text, or (with images) text and image_url parts."""
    if isinstance(content, str) or not any(isinstance(part, InputImage) for part in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": part.image_url}} if isinstance(part, InputImage)
            else {"type": "text", "text": _text([part])} for part in content]


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.refusal if isinstance(part, Refusal) else part.text for part in content)

"""An Anthropic Messages request as the chat completions request it runs as.

``to_chat_request`` is pure (the body and one fact about the chat template in,
a ``ChatCompletionRequest`` out), so the fleet router can hash a Messages
prompt exactly as a replica renders it. The mapping:

- ``system`` (a string or text blocks) -> a leading system message;
- a user turn's text blocks -> a user message, each ``tool_result`` block -> a
  ``tool`` message (``is_error`` puts "Error: " before its text), in their order;
- an assistant turn's text -> content, ``tool_use`` blocks -> ``tool_calls``;
  thinking blocks passed back are not rendered (reasoning templates drop earlier
  turns' thinking too); a last assistant turn is continued (Anthropic's prefill:
  ``continue_final_message``);
- ``tools`` -> functions, ``tool_choice`` auto/any/tool/none -> auto/required/the
  named function/none, ``disable_parallel_tool_use`` -> ``parallel_tool_calls`` false;
- ``stop_sequences`` -> ``stop``, ``metadata.user_id`` -> ``user``,
  ``output_config.format`` -> a JSON schema ``response_format``;
- ``thinking`` -> ``chat_template_kwargs: {"enable_thinking": ...}`` when the
  template has that switch; ``display: "omitted"`` -> ``include_reasoning`` false.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.common.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.messages.protocol import (
    AssistantMessage, ImageBlock, MessagesCountTokensRequest, MessagesRequest, TextBlock, ThinkingDisabled, ToolChoiceAny,
    ToolChoiceAuto, ToolChoiceTool, ToolResultBlock, ToolUseBlock, UserMessage,
)

# The chat template variable that turns a hybrid model's thinking on and off (Qwen3's).
THINKING_SWITCH = "enable_thinking"


def to_chat_request(body: MessagesCountTokensRequest, thinking_switch: bool = False) -> ChatCompletionRequest:
    """The chat request ``body`` runs as. ``thinking_switch``: the chat template in
    use reads ``enable_thinking`` (``THINKING_SWITCH in template_variables(template)``);
    without it a ``thinking`` setting passes nothing to the template. Every
    validated body translates (pydantic's ``ValidationError``, a ``ValueError``,
    would mean the two request models disagree)."""
    messages = _system(body.system)
    for message in body.messages:
        messages += _user_turn(message) if isinstance(message, UserMessage) else [_assistant_turn(message)]
    prefill = isinstance(body.messages[-1], AssistantMessage)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages,
        "add_generation_prompt": not prefill, "continue_final_message": prefill,
        **_tool_fields(body),
    }
    if body.thinking is not None:
        if thinking_switch:
            chat["chat_template_kwargs"] = {THINKING_SWITCH: not isinstance(body.thinking, ThinkingDisabled)}
        if getattr(body.thinking, "display", None) == "omitted":
            chat["include_reasoning"] = False
    if body.output_config is not None:
        chat.update(_output_config(body))
    if isinstance(body, MessagesRequest):
        chat.update(_sampling_fields(body))
    return ChatCompletionRequest.model_validate(chat)


def _sampling_fields(body: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}  # message_delta reports the usage
    optional = {"stop": body.stop_sequences or None, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": body.top_k, "user": body.metadata.user_id if body.metadata is not None else None}
    return {**fields, **{name: value for name, value in optional.items() if value is not None}}


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(block.text for block in blocks)


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    text = _text(system)
    return [{"role": "system", "content": text}] if text else []


def _user_turn(message: UserMessage) -> list[dict[str, Any]]:
    """Text and image blocks in a row make one user message; each tool result is a tool message."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    turns: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            text = _text(block.content)
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": f"Error: {text}" if block.is_error else text})
            continue
        part = {"type": "image_url", "image_url": {"url": block.url}} if isinstance(block, ImageBlock) \
            else {"type": "text", "text": block.text}
        if turns and turns[-1]["role"] == "user":
            turns[-1]["content"].append(part)
        else:
            turns.append({"role": "user", "content": [part]})
    return [{**turn, "content": _joined(turn["content"])} for turn in turns] or [{"role": "user", "content": ""}]


def _joined(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A user turn's parts as one text when they are all text (a text model's plain content)."""
    if isinstance(content, str) or any(part["type"] != "text" for part in content):
        return content
    return "".join(part["text"] for part in content)


def _assistant_turn(message: AssistantMessage) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_fields(body: MessagesCountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema.model_dump(by_alias=True, exclude_unset=True),
            **({"description": tool.description} if tool.description is not None else {})}}
            for tool in body.tools]
    choice = body.tool_choice
    if choice is None:
        return fields
    if isinstance(choice, ToolChoiceAuto):
        fields["tool_choice"] = "auto"
    elif isinstance(choice, ToolChoiceAny):
        fields["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = "none"
    if getattr(choice, "disable_parallel_tool_use", False):
        fields["parallel_tool_calls"] = False
    return fields


def _output_config(body: MessagesCountTokensRequest) -> dict[str, Any]:
    if body.output_config.format is None:
        return {}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}}

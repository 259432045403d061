"""OpenAI chat messages -> the chat template's conversation -> the prompt.

The one place both ``LLM.chat`` and the server's /v1/chat/completions (and
/tokenize) render conversations, so the two never differ. Templates are
rendered by Hugging Face's ``apply_chat_template`` (a sandboxed Jinja
environment). Safety rules:

- A template given as a file path is read only when it comes from the operator
  (``--chat-template``, ``LLM.chat(chat_template=...)``); a request's own
  ``chat_template`` is inline text only and is refused unless the server was
  started with ``--trust-request-chat-template`` (a template is code: a heavy
  one can hold the event loop).
- Nothing the client sends is dropped silently: ``tools`` the template never
  reads, or ``chat_template_kwargs`` it never uses, are a ``ValueError``.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

_TEMPLATES_DIR = Path(__file__).parent / "openai" / "templates"
# Short names for the templates shipped in the package (``--chat-template hermes``).
SHIPPED_TEMPLATES = {"hermes": _TEMPLATES_DIR / "tool_chat_template_hermes.jinja"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat-template settings (``--chat-template``, ``--trust-request-chat-template``)."""

    chat_template: str | None = None
    trust_request_chat_template: bool = False


@dataclass(frozen=True)
class ChatRenderOptions:
    """How one conversation is rendered (the chat request's template fields)."""

    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def load_chat_template(value: str | None) -> str | None:
    """An operator's template: a shipped name (``hermes``), a file path, or
    inline Jinja (anything with a brace or a newline), as vLLM's --chat-template.
    Raises ``ValueError`` when it is none of these or does not parse."""
    if value is None:
        return None
    if any(c in value for c in "{}\n"):
        template = value
    elif value in SHIPPED_TEMPLATES:
        template = SHIPPED_TEMPLATES[value].read_text(encoding="utf-8")
    else:
        try:
            template = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"chat template {value!r}: cannot read it ({exc.strerror}); pass a file path, inline "
                             f"Jinja, or a shipped name ({', '.join(SHIPPED_TEMPLATES)})") from exc
    template_variables(template)  # fail now, not on the first request
    return template


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """Every variable the template reads from its context (``messages``, ``tools``,
    ``enable_thinking``, ...). Raises ``ValueError`` if the template does not parse."""
    # Parse in Hugging Face's own environment, so its extensions (``{% generation %}``) parse too.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        environment = _compile_jinja_template(template).environment
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc.message} (line {exc.lineno})") from exc


def rendering_arguments(tokenizer: Any) -> frozenset[str]:
    """``apply_chat_template``'s own arguments (tools, tokenize, ...), which
    ``chat_template_kwargs`` may not set: they are not template variables."""
    return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}


def conversation_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them. Assistant ``tool_calls`` and
    tool results (``tool_call_id``, ``name``) are kept; each call's ``arguments``
    JSON string becomes a dict (Hermes/Qwen/Llama templates render it with
    ``tojson``), as vLLM does. Raises ``ValueError`` naming the bad message field."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with a role and content, got {message!r}")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {role!r}")
        turn = {**message, "content": _text_content(message.get("content"), f"messages[{i}].content")}
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls is only allowed on assistant messages, not {role!r}")
            turn["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                  for j, call in enumerate(message["tool_calls"])]
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}] has role 'tool' and needs the tool_call_id it answers")
        conversation.append({key: value for key, value in turn.items() if value is not None})
    return conversation


def _text_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Plain content, or the text parts of a content list joined; None is ""
    (an assistant turn that only calls tools), which every template can print.
    Content with images stays a list of parts: text, and ``{"type": "image", "url"}``."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text and image_url parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str):
                raise ValueError(f"{where}[{j}].image_url must be {{\"url\": \"data:image/...\"}}")
            parts.append({"type": "image", "url": url})
        else:
            raise ValueError(f"{where}[{j}]: only text and image_url content parts are supported, got type {kind!r}")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {exc.msg}") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], options: ChatRenderOptions,
                images: Any = None) -> dict[str, Any]:
    """The prompt dict (text and token ids) for one conversation; with ``image_url``
    parts, also its processed images (``images``: the model's ``ImagePromptProcessor``,
    None for a text-only model). Raises ``ValueError`` naming the field to change: no
    template, tools the template ignores, unused or reserved ``chat_template_kwargs``,
    ``continue_final_message`` without a final assistant message or together with
    ``add_generation_prompt``, an image a text-only model is sent or that cannot be read."""
    template = options.chat_template or getattr(images, "chat_template", None) or tokenizer.chat_template
    if not template:
        raise ValueError("this model has no chat template; pass chat_template (--chat-template on the server)")
    variables = template_variables(template)
    if options.tools and "tools" not in variables:
        raise ValueError("tools: the chat template in use never renders tools, so the model would not see them; "
                         "use a tool-aware template (--chat-template hermes on the server, chat_template='hermes' "
                         "in LLM.chat) or leave tools out")
    kwargs = dict(options.chat_template_kwargs or {})
    # apply_chat_template's own arguments (tools, tokenize, ...) are not template variables to override.
    reserved = sorted(rendering_arguments(tokenizer) & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} are rendering arguments, not template "
                         "variables; use the request fields of those names (tools, add_generation_prompt, ...)")
    unused = sorted(kwargs.keys() - variables)
    if unused:
        raise ValueError(f"chat_template_kwargs: the chat template never reads {', '.join(unused)}")
    conversation = conversation_for_template(messages)
    if options.continue_final_message:
        if options.add_generation_prompt:
            raise ValueError("continue_final_message continues the last assistant message; "
                             "set add_generation_prompt to false with it")
        if conversation[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's, "
                             f"got role {conversation[-1]['role']!r}")
    pictures = chat_images(conversation, images)
    if images is not None:
        conversation = image_content_format(conversation, template, images.image_token)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=options.tools, chat_template=template, tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **kwargs,
        )
    except jinja2.TemplateError as exc:  # the template's own checks (raise_exception) and render errors
        raise ValueError(f"messages: the chat template refused this conversation: {exc}") from exc
    if not pictures:
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    if text.count(images.image_token) != len(pictures):
        raise ValueError(f"messages: the chat template wrote {text.count(images.image_token)} image placeholders "
                         f"for {len(pictures)} images; use a template that renders {{\"type\": \"image\"}} parts")
    return images.processed({"prompt": text, "multi_modal_data": {"image": pictures}})


def chat_images(conversation: list[dict[str, Any]], images: Any) -> list[Any]:
    """The images of a conversation's ``image_url`` parts, loaded in order by ``images``
    (``ValueError`` naming the part: a text-only model, too many images, an unreadable one)."""
    where = [(f"messages[{i}].content[{j}]", part["url"]) for i, turn in enumerate(conversation)
             if isinstance(turn["content"], list) for j, part in enumerate(turn["content"]) if part["type"] == "image"]
    if not where:
        return []
    if images is None:
        raise ValueError(f"{where[0][0]}: this model takes text only; send text content or serve a "
                         "vision-language model")
    try:
        images.check_count(len(where))
    except ValueError as exc:
        raise ValueError(f"messages: {exc}") from exc
    pictures = []
    for name, url in where:
        try:
            pictures.append(images.load(url))
        except ValueError as exc:
            raise ValueError(f"{name}.image_url: {exc}") from exc
    return pictures


_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def image_content_format(conversation: list[dict[str, Any]], template: str, image_token: str) -> list[dict[str, Any]]:
    """A vision-language model's conversation as its template reads it (vLLM's content
    formats): a template that loops over ``message['content']`` gets lists of parts
    (``{"type": "text", "text"}``, ``{"type": "image"}``, Hugging Face's shape); any other gets
    strings with the processor's image token where each image goes."""
    loops = bool(_ITERATES_CONTENT.search(template))
    turns = []
    for turn in conversation:
        content = turn["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else \
            [part if part["type"] == "text" else {"type": "image"} for part in content]
        flat = "".join(part["text"] if part["type"] == "text" else image_token for part in parts)
        turns.append({**turn, "content": parts if loops else flat})
    return turns

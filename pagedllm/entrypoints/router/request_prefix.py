"""A request body's prompt as the replica will tokenize it: what the router hashes.

The router renders and tokenizes exactly as a replica's API server does (the
same ``render_chat`` and the same tokenizer, read from the same model, with the
same ``--chat-template``), so its block hashes equal the ones the replica's KV
events announce. ``prompt_fingerprint`` lets the router check that at start-up:
a replica whose fingerprint differs renders prompts differently, and prefix
routing to it would never hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

from pagedllm.entrypoints.chat_utils import ChatRenderOptions, render_chat, template_variables
from pagedllm.entrypoints.openai.common import routes
from pagedllm.entrypoints.openai.messages import to_chat as messages_to_chat
from pagedllm.entrypoints.openai.responses import input as responses_input
from pagedllm.entrypoints.openai.common.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.messages.protocol import MessagesRequest
from pagedllm.entrypoints.openai.responses.protocol import ResponsesRequest
from pagedllm.entrypoints.openai.chat.serving import render_inputs
from pagedllm.entrypoints.openai.common.state import cache_salt_of

_PROBE_CONVERSATION = [{"role": "system", "content": "You route requests."},
                       {"role": "user", "content": "Which replica holds this prefix?"}]


def routing_token_ids(path: str, body: Any, tokenizer: Any, chat_template: str | None) -> list[int]:
    """The prompt token ids of a request to ``path`` (the first prompt of a
    batch); empty when the body has no prompt the router can read (the replica
    will judge the request; the router then routes by load alone)."""
    if not isinstance(body, dict):
        return []
    try:
        chat = _as_chat_request(path, body, tokenizer, chat_template)
        if chat is not None:
            conversation, options = render_inputs(chat, chat_template)
            return list(render_chat(tokenizer, conversation, options)["prompt_token_ids"])
        if path == routes.COMPLETIONS:
            return _completion_token_ids(body.get("prompt"), tokenizer)
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        return []  # a request the replica will refuse with its own 400
    return []


def _as_chat_request(path: str, body: dict, tokenizer: Any, chat_template: str | None) -> ChatCompletionRequest | None:
    """The chat request a replica runs for a chat, Responses or Messages body (None for
    other paths), validated by the server's own request models and translated by its own
    functions, so the conversation renders as the replica's does. A Responses body's
    ``previous_response_id`` conversation lives on the replica that stored it: the router
    sends the request there (``response_homes``) and hashes only the new input."""
    if path == routes.CHAT:
        return ChatCompletionRequest.model_validate(body)
    if path == routes.RESPONSES:
        return responses_input.to_chat_request(ResponsesRequest.model_validate(body), [])
    if path == routes.MESSAGES:
        switch = messages_to_chat.THINKING_SWITCH in template_variables(chat_template or tokenizer.chat_template)
        return messages_to_chat.to_chat_request(MessagesRequest.model_validate(body), switch)
    return None


def _completion_token_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str) and prompt:
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return []


def routing_salt(body: Any, tenant: str | None) -> str | None:
    """The cache salt the replica will apply to this body (the server's own rule)."""
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return cache_salt_of(tenant, salt if isinstance(salt, str) else None)


def routing_lora_name(body: Any, base_model_names: Collection[str]) -> str | None:
    """The LoRA adapter the replica will key this body's blocks by: its ``model``. The
    router does not decide which adapters exist (they are loaded and unloaded on the
    replicas), so any ``model`` that is not one of the base model's served names (a
    replica's /server_info ``model_names``) is taken as an adapter's name; one no replica
    serves gets a 404 there, so hashing it as an adapter costs nothing. (The adapter's
    fingerprint, the rest of its key, is the replica's /server_info ``lora_adapters``.)"""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model not in base_model_names else None


def prompt_fingerprint(tokenizer: Any, chat_template: str | None) -> str:
    """A short digest of how a probe conversation renders and tokenizes: equal on
    the router and a replica exactly when both would hash prompts alike."""
    token_ids = render_chat(tokenizer, _PROBE_CONVERSATION, ChatRenderOptions(chat_template=chat_template)) \
        if (chat_template or tokenizer.chat_template) else {"prompt_token_ids": tokenizer.encode("probe")}
    return hashlib.sha256(repr(list(token_ids["prompt_token_ids"])).encode()).hexdigest()[:16]

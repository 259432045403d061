"""The router reads a Responses or Messages body's prompt as the replica renders it:
the same conversation through any front door hashes to the same tokens."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.common.routes import CHAT as CHAT_PATH
from pagedllm.entrypoints.openai.common.routes import MESSAGES as MESSAGES_PATH
from pagedllm.entrypoints.openai.common.routes import RESPONSES as RESPONSES_PATH
from pagedllm.entrypoints.router.request_prefix import routing_token_ids
from pagedllm.model.loader import load_tokenizer

SYSTEM, QUESTION = "You answer in one word.", "Which ocean is largest?"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.mark.parametrize("template", [None, "hermes"])
def test_the_three_front_doors_hash_one_conversation_alike(tokenizer, template):
    template = load_chat_template(template)
    chat = routing_token_ids(CHAT_PATH, {"messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": QUESTION}]}, tokenizer, template)
    responses = routing_token_ids(RESPONSES_PATH, {"model": "m", "instructions": SYSTEM, "input": QUESTION},
                                  tokenizer, template)
    messages = routing_token_ids(MESSAGES_PATH, {"model": "m", "max_tokens": 8, "system": SYSTEM,
                                                 "messages": [{"role": "user", "content": QUESTION}]},
                                 tokenizer, template)
    assert len(chat) > 10 and chat == responses == messages


def test_a_body_the_replica_refuses_is_routed_by_load_alone(tokenizer):
    assert routing_token_ids(MESSAGES_PATH, {"messages": [{"role": "user", "content": "hi"}]}, tokenizer, None) == []
    assert routing_token_ids(RESPONSES_PATH, {"input": 5}, tokenizer, None) == []


def test_a_body_with_an_image_is_routed_by_load_alone(tokenizer):
    """The router has no image processor: it cannot hash the image's blocks (keyed by its content),
    so it claims no prefix at all rather than a text-only match past the image."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}]}
    assert routing_token_ids(CHAT_PATH, body, tokenizer, load_chat_template("hermes")) == []

"""The Responses API's store of responses: per tenant, bounded in entries and bytes, LRU."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.responses.store import ResponseStore


def response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}


CONVERSATION = [{"role": "user", "content": "hello"}]


def size_of(rid: str, text: str = "hi") -> int:
    return len(json.dumps(response(rid, text)).encode()) + len(json.dumps(CONVERSATION).encode())


def test_put_get_delete_and_copies_are_independent():
    store = ResponseStore()
    assert store.put("a", response("resp_1"), CONVERSATION)
    got = store.get("a", "resp_1")
    assert got.response == response("resp_1") and got.conversation == CONVERSATION
    got.response["output"].clear()
    got.conversation.append({"role": "assistant", "content": "changed"})
    assert store.get("a", "resp_1").response == response("resp_1")  # what a caller changes is not stored
    assert store.get("a", "resp_1").conversation == CONVERSATION
    assert store.usage("a") == (1, size_of("resp_1"))
    assert store.delete("a", "resp_1") and not store.delete("a", "resp_1")
    assert store.get("a", "resp_1") is None and store.usage("a") == (0, 0)


def test_a_tenant_never_sees_another_tenants_responses():
    store = ResponseStore()
    store.put("a", response("resp_1"), CONVERSATION)
    store.put(None, response("resp_2"), CONVERSATION)
    for tenant in ("b", None):
        assert store.get(tenant, "resp_1") is None and not store.delete(tenant, "resp_1")
    assert store.get("a", "resp_2") is None
    assert store.get("a", "resp_1") is not None and store.get(None, "resp_2") is not None


def test_the_least_recently_used_entry_goes_first_when_the_count_is_full():
    store = ResponseStore(max_entries=2)
    store.put("a", response("resp_1"), CONVERSATION)
    store.put("a", response("resp_2"), CONVERSATION)
    store.get("a", "resp_1")  # now resp_2 is the least recently used
    store.put("a", response("resp_3"), CONVERSATION)
    assert store.get("a", "resp_2") is None
    assert store.get("a", "resp_1") is not None and store.get("a", "resp_3") is not None
    # Each tenant has its own bound: b's entries evict none of a's.
    for i in range(5):
        store.put("b", response(f"resp_b{i}"), CONVERSATION)
    assert store.usage("a")[0] == 2 and store.usage("b")[0] == 2


def test_the_byte_bound_evicts_until_the_new_entry_fits():
    one = size_of("resp_1")
    store = ResponseStore(max_bytes=2 * one + 5)
    store.put("a", response("resp_1"), CONVERSATION)
    store.put("a", response("resp_2"), CONVERSATION)
    assert store.usage("a") == (2, 2 * one)
    store.put("a", response("resp_3"), CONVERSATION)
    assert store.get("a", "resp_1") is None and store.usage("a") == (2, 2 * one)
    # An entry over the bound alone is not stored and evicts nothing.
    assert not store.put("a", response("resp_big", "x" * (3 * one)), CONVERSATION)
    assert store.get("a", "resp_big") is None and store.usage("a") == (2, 2 * one)


def test_storing_an_id_again_replaces_it_and_a_zero_bound_stores_nothing():
    store = ResponseStore(max_entries=2)
    store.put("a", response("resp_1"), CONVERSATION)
    store.put("a", response("resp_1", "again"), CONVERSATION)
    assert store.usage("a") == (1, size_of("resp_1", "again"))
    assert store.get("a", "resp_1").response == response("resp_1", "again")
    off = ResponseStore(max_entries=0)
    assert not off.put("a", response("resp_1"), CONVERSATION) and off.get("a", "resp_1") is None
    with pytest.raises(ValueError, match="bounds must be >= 0"):
        ResponseStore(max_bytes=-1)


def test_non_ascii_text_is_counted_in_utf8_bytes():
    store = ResponseStore()
    store.put("a", response("resp_1", "é" * 10), CONVERSATION)
    expected = len(json.dumps(response("resp_1", "é" * 10), ensure_ascii=False).encode()) + len(
        json.dumps(CONVERSATION).encode())
    assert store.usage("a") == (1, expected)

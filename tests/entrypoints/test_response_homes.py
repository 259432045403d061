"""The router's memory of which replica stored each Responses API response."""

from __future__ import annotations

import json

from pagedllm.entrypoints.router.response_homes import ResponseHomes


def created_event(response_id: str) -> bytes:
    data = {"type": "response.created", "sequence_number": 0, "response": {"id": response_id, "object": "response"}}
    return f"event: response.created\ndata: {json.dumps(data)}\n\n".encode()


def test_a_stored_response_is_read_where_it_was_made():
    homes = ResponseHomes()
    assert homes.learn("/v1/responses", 1, json.dumps({"id": "resp_abc", "object": "response"}).encode())
    assert homes.learn("/v1/responses", 0, created_event("resp_def"))
    assert homes.home_of("POST", "/v1/responses", {"input": "more", "previous_response_id": "resp_abc"}) == 1
    assert homes.home_of("GET", "/v1/responses/resp_def", None) == 0
    assert homes.home_of("DELETE", "/v1/responses/resp_def", None) == 0
    assert homes.home_of("GET", "/v1/responses/resp_def/input_items", None) == 0
    # Anything else goes wherever the policy sends it.
    assert homes.home_of("POST", "/v1/responses", {"input": "new"}) is None
    assert homes.home_of("POST", "/v1/responses", {"previous_response_id": "resp_unknown"}) is None
    assert homes.home_of("POST", "/v1/chat/completions", {"previous_response_id": "resp_abc"}) is None


def test_only_responses_answers_teach_it_and_a_head_without_an_id_does_not():
    homes = ResponseHomes()
    assert not homes.learn("/v1/chat/completions", 0, b'{"id": "resp_x"}')
    assert not homes.learn("/v1/responses", 0, b'event: response.created\ndata: {"type": "resp')
    assert len(homes) == 0


def test_it_remembers_a_bounded_number_least_recently_used_out():
    homes = ResponseHomes(capacity=2)
    for index, response_id in enumerate(["resp_a", "resp_b"]):
        homes.learn("/v1/responses", index, created_event(response_id))
    assert homes.home_of("GET", "/v1/responses/resp_a", None) == 0  # resp_a is now the most recent
    homes.learn("/v1/responses", 1, created_event("resp_c"))
    assert len(homes) == 2
    assert homes.home_of("GET", "/v1/responses/resp_b", None) is None
    assert homes.home_of("GET", "/v1/responses/resp_a", None) == 0

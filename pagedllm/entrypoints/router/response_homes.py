"""Which replica stored each Responses API response, so the requests that read it
(``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``) reach it.

A replica keeps its stored responses in its own memory (``openai.responses.store``); the
router learns each id from the replica's answer (the JSON body, or a stream's
``response.created`` event) and remembers a bounded number, least recently used
out. An id the router does not know (evicted, or made before it started) is
routed as any request, and a replica that lacks it answers 404 as OpenAI does.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from pagedllm.entrypoints.openai.common.routes import RESPONSES

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
# A stream's response.created event comes first; its id is within this many bytes.
SNIFF_BYTES = 8192


class ResponseHomes:
    """Response id -> the index of the replica that stored it (at most ``capacity``, LRU)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def home_of(self, method: str, path: str, body: Any) -> int | None:
        """The replica a request must reach because it reads a stored response (None: any)."""
        if path.startswith(RESPONSES + "/"):
            response_id = path[len(RESPONSES) + 1:].split("/", 1)[0]
        elif path == RESPONSES and method == "POST" and isinstance(body, dict):
            response_id = body.get("previous_response_id")
        else:
            return None
        if not isinstance(response_id, str) or response_id not in self._homes:
            return None
        self._homes.move_to_end(response_id)
        return self._homes[response_id]

    def learn(self, path: str, replica_index: int, head: bytes) -> bool:
        """Remember the response id at the start of a ``POST /v1/responses`` answer
        (``head``: its first bytes); False when there is none in them (yet)."""
        if path != RESPONSES:
            return False
        match = _RESPONSE_ID.search(head)
        if match is None:
            return False
        self._homes[match.group(1).decode()] = replica_index
        self._homes.move_to_end(match.group(1).decode())
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)
        return True

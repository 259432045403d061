"""The stored responses of the Responses API (``store``, ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}``): each keeps its Response object and the
conversation so far (chat messages, without the request's ``instructions``, which
OpenAI does not carry over), so a follow-up continues it.

Bounded by construction: every tenant (the tenant of the API key; the keys
without one, and a server without keys, share one) has its own LRU of at most
``max_entries`` responses and ``max_bytes`` bytes of JSON, so one tenant's
traffic never evicts another's, and the whole store holds at most
``(tenants + 1) x max_bytes``. Entries are kept as serialized JSON: their size is
exact and nothing a route does to a loaded copy changes what is stored.

One tenant can never see another's responses: every lookup is keyed by
(tenant, id), and a miss looks the same whether the id is unknown, evicted or
another tenant's. Pure Python (no torch), kept in the API server's process.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# Defaults of --responses-store-max-entries / --responses-store-max-bytes (per tenant).
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    """A loaded entry: fresh copies, the caller may change them."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


@dataclass
class _TenantEntries:
    """One tenant's entries, least recently used first: id -> (response JSON, conversation JSON)."""

    entries: OrderedDict[str, tuple[bytes, bytes]] = field(default_factory=OrderedDict)
    size: int = 0


class ResponseStore:
    """Stored responses per tenant, each tenant bounded in entries and bytes (LRU)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must be >= 0, got {max_entries} entries "
                             f"and {max_bytes} bytes")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._tenants: dict[str | None, _TenantEntries] = {}

    def put(self, tenant: str | None, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store ``response`` (under its ``id``) with its conversation, evicting the
        tenant's least recently used entries to make room. False (nothing stored,
        nothing evicted) when it alone is over ``max_bytes`` or the store is off
        (a bound of 0)."""
        response_json = json.dumps(response, ensure_ascii=False).encode()
        conversation_json = json.dumps(conversation, ensure_ascii=False).encode()
        size = len(response_json) + len(conversation_json)
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self._remove(tenant, response["id"])  # storing an id again replaces its entry
        entries = self._tenants.setdefault(tenant, _TenantEntries())
        while entries.entries and (len(entries.entries) >= self.max_entries or entries.size + size > self.max_bytes):
            _pop(entries, next(iter(entries.entries)))
        entries.entries[response["id"]] = (response_json, conversation_json)
        entries.size += size
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The tenant's entry of that id (now its most recently used), or None."""
        entries = self._tenants.get(tenant)
        if entries is None or response_id not in entries.entries:
            return None
        entries.entries.move_to_end(response_id)
        response_json, conversation_json = entries.entries[response_id]
        return StoredResponse(json.loads(response_json), json.loads(conversation_json))

    def delete(self, tenant: str | None, response_id: str) -> bool:
        """Remove the tenant's entry of that id; False when it has none."""
        return self._remove(tenant, response_id)

    def usage(self, tenant: str | None) -> tuple[int, int]:
        """(entries, bytes) the tenant holds."""
        entries = self._tenants.get(tenant)
        return (0, 0) if entries is None else (len(entries.entries), entries.size)

    def _remove(self, tenant: str | None, response_id: str) -> bool:
        entries = self._tenants.get(tenant)
        if entries is None or response_id not in entries.entries:
            return False
        _pop(entries, response_id)
        if not entries.entries:
            del self._tenants[tenant]  # a tenant with nothing stored costs nothing
        return True


def _pop(entries: _TenantEntries, response_id: str) -> None:
    response_json, conversation_json = entries.entries.pop(response_id)
    entries.size -= len(response_json) + len(conversation_json)

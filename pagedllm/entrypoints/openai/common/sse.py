"""Server-sent events, the one framing of every stream: chat and completions
send unnamed ``data:`` events closed by ``[DONE]``; Responses and Messages name
each event by its type. The schema of one event (OpenAPI 3.2's itemSchema)
is written here too, so the document and the bytes are one fact."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

MEDIA_TYPE = "text/event-stream"
# The last event of a chat or completions stream.
DONE = "data: [DONE]\n\n"


def data_event(payload: dict[str, Any]) -> str:
    """An unnamed event: ``payload`` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


def named_event(kind: str, payload: dict[str, Any]) -> str:
    """An event named ``kind`` whose data is ``payload`` (which carries ``type`` itself)."""
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


def event_schema(data_description: str, kinds: Sequence[str] | None = None) -> dict[str, Any]:
    """The schema of one event: its ``data`` and, for named streams, its ``event`` out of ``kinds``."""
    if kinds is None:
        return {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string", "description": data_description}}}
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string", "enum": list(kinds)},
        "data": {"type": "string", "description": data_description}}}


def stream_content(schema: dict[str, Any]) -> dict[str, Any]:
    """The ``content`` entry of an OpenAPI response that may be a stream of these events."""
    return {MEDIA_TYPE: {"schema": schema}}

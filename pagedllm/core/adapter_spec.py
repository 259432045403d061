"""What crosses from the scheduler about a request's LoRA adapter (its page-ins are
``core.block_moves.AdapterLoad`` records of the step's plan)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterSpec:
    """What the scheduler knows of a request's adapter: its name, where it is read from, how
    many pages it takes, and ``fingerprint``, a digest of its files' bytes. The prefix-cache key
    holds the name and the fingerprint, so K/V computed under one set of weights is never served
    to other weights under the same name (an adapter reloaded from another file, a disk tier
    that outlived a restart)."""

    name: str
    path: str
    num_pages: int
    fingerprint: str = ""


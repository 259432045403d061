"""What crosses from the scheduler about LoRA adapters: a request's adapter, and page-ins."""

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


@dataclass(frozen=True)
class AdapterLoad:
    """A page-in for the runner: read ``path`` into the pages from ``first_block`` on,
    before this step's forward."""

    name: str
    path: str
    first_block: int

"""What crosses from the scheduler about LoRA adapters: a request's adapter, and page-ins."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterSpec:
    """What the scheduler knows of a request's adapter: its name (the identity of its
    weights, in the prefix-cache key), where it is read from, how many pages it takes."""

    name: str
    path: str
    num_pages: int


@dataclass(frozen=True)
class AdapterLoad:
    """A page-in for the runner: read ``path`` into the pages from ``first_block`` on,
    before this step's forward."""

    name: str
    path: str
    first_block: int

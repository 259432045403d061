"""What the prefix cache tells the world: blocks stored, removed, all cleared.

Plain, torch-free records made where the fact happens (the block pool for the
pool, the tiers for host memory and disk) and appended to a ``KVEventLog``; the
publisher (``pagedllm.kv_tiers.events``) drains the log off the step path and
puts the records on the wire in vLLM's KV-event format. Hashes here are the
engine's own ``BlockHash`` digests; the wire carries ``external_block_hash``
of each (``pagedllm.core.block_hash``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from pagedllm.core.block_hash import BlockHash

# Where a block is, named as vLLM names its media: the KV pool is "GPU" there
# whatever the device (vLLM's MEDIUM_GPU), its CPU offloading tier "CPU", storage "DISK".
MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(frozen=True)
class BlockStored:
    """Blocks now held in ``medium``: consecutive blocks of one request, each
    ``block_size`` tokens (``token_ids`` is all their tokens, in order); the
    first block's parent is ``parent_block_hash`` (None for a request's first block)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str
    image_keys: tuple = ()  # the ["mm", content hash] keys of a pool block over images (``block_image_keys``)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks ``medium`` no longer holds."""

    block_hashes: list[BlockHash]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of every medium is gone (vLLM sends it on a prefix-cache reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class KVEventLog:
    """Events in the order they happened, until a reader takes them.

    Appending is O(1) and nothing else happens on the step path; ``take``
    hands the batch over and starts a new one (the engine calls it once per
    step, then publishes the batch from another thread)."""

    events: list[KVEvent] = field(default_factory=list)

    def append(self, event: KVEvent) -> None:
        self.events.append(event)

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

"""KV cache events on the wire, in vLLM's format, so a router built for vLLM
(llm-d, NVIDIA Dynamo) consumes pagedllm's: what the publisher
(``pagedllm.kv_tiers.events``) sends and a subscriber (the router's
``ReplicaWatch``) decodes, neither owning the other's side.

Each batch is a msgpack array ``[ts, [event, ...], data_parallel_rank]``;
each event a tagged array: ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved",
block_hashes, medium]``, ``["AllBlocksCleared"]``. Hashes are
``external_block_hash`` ints (``pagedllm.core.block_hash``). A replay answer
ends with the sequence number ``END_OF_REPLAY`` (docs/kv_events.md).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.core import kv_events as core
from pagedllm.core.block_hash import external_block_hash

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # vLLM's: the sequence number -1, eight 0xff bytes


# The wire structs: class names, field order and options are vLLM's
# (vllm/distributed/kv_events.py); a subscriber decodes either engine's batches.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the wire events (the tag is the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    # Per block, the extra keys its hash has beyond the tokens that a subscriber may see: the
    # ["mm", content hash] of each image it covers (vLLM's field; the cache salt is never sent).
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(events: list[core.KVEvent]) -> list[KVCacheEvent]:
    """The engine's event records as wire events (hashes as their external ints, no LoRA)."""
    wire: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, core.BlockStored):
            parent = None if event.parent_block_hash is None else external_block_hash(event.parent_block_hash)
            extra = [[list(key) for key in event.image_keys]] if event.image_keys else None
            wire.append(BlockStored([external_block_hash(h) for h in event.block_hashes], parent,
                                    list(event.token_ids), event.block_size, None, event.medium, extra_keys=extra))
        elif isinstance(event, core.BlockRemoved):
            wire.append(BlockRemoved([external_block_hash(h) for h in event.block_hashes], event.medium))
        elif isinstance(event, core.AllBlocksCleared):
            wire.append(AllBlocksCleared())
        else:
            raise ValueError(f"to_wire: not a KV event of pagedllm.core.kv_events: {event!r}")
    return wire

"""The prefix cache: lookups across the pool and the tiers below it, and registration.

Full blocks are found again by their chained hash (``core/block_hash.py``): in
the pool's hash map first, then (with tiers, ``core/tier_index.py``) in host
memory and on disk. The block tables stay the KV manager's; this class only
reads a table to register its full blocks.
"""

from __future__ import annotations

from pagedllm.core.block_hash import BlockHash, extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.block_table import BlockTableRecord
from pagedllm.core.kv_events import AllBlocksCleared, KVEventLog
from pagedllm.core.kv_interface import PrefixHit
from pagedllm.core.request import Request
from pagedllm.core.tier_index import TierIndex, TierMoves


class PrefixCache:
    """Owns the block pool's hash map side: what is cached, where, and what a lookup finds.

    Safety rules:
    - A lookup stops at the first miss and short of the last token (at least
      one token is computed, so there are logits to sample from); a request
      that asks for prompt logprobs never hits (their logits are never computed
      for cached positions).
    - A tier hit is a hash, not a block: ``load_from_tiers`` gives it a fresh
      block only once the caller has counted that block as needed (the
      manager's all-or-nothing check), and the tiers load its bytes before the
      forward. It is registered by the step's ``register``, like any block.
    - An evicted hashed block is offered to the tiers (``BlockPool.on_evict``)
      before its hash is forgotten; a newly registered one is persisted.
    """

    def __init__(self, num_blocks: int, block_size: int, enabled: bool, tiers: TierIndex | None = None,
                 events: KVEventLog | None = None) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.tiers = tiers
        self.block_pool = BlockPool(num_blocks, on_evict=self._offload if tiers is not None else None, events=events)
        # Lookups of admitted requests, in tokens.
        self.queries = 0
        self.hits = 0

    def prefetch(self, request: Request) -> None:
        """Start fetching from disk the prefix blocks a new request will look up, so
        the reads overlap the steps it waits through (its lookup then finds them
        in host memory, or waits only for what is still being read)."""
        if self.tiers is not None and self.tiers.has_disk:
            self.lookup(request)

    def lookup(self, request: Request) -> PrefixHit:
        """Cached pool blocks of the request's leading full blocks, then the
        hashes of those host memory holds, up to the first miss; ``loading``
        when the next ones are being fetched from disk (the request should wait)."""
        if not self.enabled or request.sampling_params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.extra_keys)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock | BlockHash] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        loading = False
        if self.tiers is not None and len(hits) < max_blocks:
            num_ready, loading = self.tiers.lookup(hashes[len(hits):max_blocks])
            hits += hashes[len(hits):len(hits) + num_ready]
        return PrefixHit(hits, len(hits) * self.block_size, loading)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enabled:
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def load_from_tiers(self, block_hashes: list[BlockHash]) -> list[KVCacheBlock]:
        """Fresh blocks into which the tiers load these blocks before the forward."""
        if not block_hashes:
            return []
        blocks = self.block_pool.get_new_blocks(len(block_hashes))
        for block, block_hash in zip(blocks, block_hashes):
            self.tiers.load(block_hash, block.block_id)
        return blocks

    def _offload(self, block: KVCacheBlock) -> None:
        parent, token_ids = block.origin or (None, None)
        self.tiers.offload(block.block_id, block.block_hash, parent, token_ids)

    def register(self, request: Request, record: BlockTableRecord, num_tokens: int) -> None:
        """Register the table's blocks that the request's first ``num_tokens`` tokens fill."""
        if not self.enabled:
            return
        num_full = min(num_tokens // self.block_size, len(record.entries))
        if num_full <= record.num_registered:
            return
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.extra_keys)
        # Token ids and parents only for the events and tiers that announce blocks.
        described = self.block_pool.events is not None
        tokens, size = request.all_token_ids, self.block_size
        # Released entries hold no block to register (after a swap-in restarts from 0).
        for index in range(max(record.num_registered, record.num_released), num_full):
            parent = hashes[index - 1] if index else None
            block_tokens = tokens[index * size:(index + 1) * size] if described else ()
            block = record.entries[index]
            if self.block_pool.cache_block(block, hashes[index], parent, block_tokens) and self.tiers is not None:
                self.tiers.persist(block.block_id, hashes[index], parent, block_tokens or None)
        record.num_registered = num_full

    def reset(self) -> int:
        """Forget the cached blocks no request uses, in the pool and in host memory
        (the disk tier is shared and persistent: it keeps its files). The events
        say which went; when nothing is left anywhere, ``AllBlocksCleared`` too."""
        if self.tiers is not None:
            self.tiers.clear_host()
        dropped = self.block_pool.reset_prefix_cache()
        events = self.block_pool.events
        nothing_left = not self.block_pool.cached_blocks and (
            self.tiers is None or (not self.tiers.num_host_blocks and not self.tiers.has_disk))
        if events is not None and nothing_left:
            events.append(AllBlocksCleared())
        return dropped

    def take_tier_moves(self) -> TierMoves:
        return self.tiers.take_moves() if self.tiers is not None else TierMoves()

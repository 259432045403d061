"""The prefix cache: lookups across the pool and the tiers below it, and registration.

Full blocks are found again by their chained hash (``core/block_hash.py``): in
the pool's hash map first, then (with tiers, ``core/tier_index.py``) in host
memory and on disk. Each KV cache group caches its own blocks under
``(group, hash)``: the hashes are the same in every group, the K/V are not.
The block tables stay the KV manager's; this class only reads a table to
register its full blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.block_hash import BlockHash, block_image_keys, extend_block_hashes
from pagedllm.core.block_moves import BlockMovePlan
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.block_table import BlockTableRecord
from pagedllm.core.kv_events import AllBlocksCleared, KVEventLog
from pagedllm.core.kv_interface import PrefixHit
from pagedllm.core.kv_managers.full_attention import FullAttention
from pagedllm.core.kv_managers.kinds import AttentionKind
from pagedllm.core.request import Request
from pagedllm.core.tier_index import TierIndex

# A prefix hit's entry in one group: a cached pool block, a tier's hash, or None (outside the window or chunk).
HitEntry = KVCacheBlock | BlockHash | None


class PrefixCache:
    """Owns the block pool's hash map side: what is cached, where, and what a lookup finds.

    Safety rules:
    - A lookup stops short of the last token (at least one token is computed,
      so there are logits to sample from); a request that asks for prompt
      logprobs never hits (their logits are never computed for cached positions).
    - The hit is the longest block-aligned prefix ``h`` every group can resume
      from: a full-attention group needs every block before ``h`` cached, a
      sliding group of window ``W`` or a chunked group of chunk ``C`` only the
      blocks a query at ``h`` reads (those its kind has not released at ``h``:
      the window before ``h``, or ``h``'s chunk from its start; ``core/kv_managers/``).
      Such a group's entries before them are None: the request never takes them.
      "Cached" means in the pool or in host memory, under the group's own key
      (``tier_key``), or on disk (the request waits for the fetch): a full
      group's tier run follows its pool run, a sliding group's tier hits fill
      its pool misses inside the windows the search for ``h`` walks.
    - A tier hit is a hash, not a block: ``load_from_tiers`` gives it a fresh
      block only once the caller has counted that block as needed (the
      manager's all-or-nothing check), and the tiers load its bytes before the
      forward. It is registered by the step's ``register``, like any block.
    - An evicted hashed block is offered to the tiers (``BlockPool.on_evict``)
      before its hash is forgotten; a newly registered one is persisted.
    """

    def __init__(self, num_blocks: int, block_size: int, enabled: bool, tiers: TierIndex | None = None,
                 events: KVEventLog | None = None, kinds: Sequence[AttentionKind] = (FullAttention(),)) -> None:
        self.block_size = block_size
        # Each KV cache group's attention kind, in group order.
        self.kinds = tuple(kinds)
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
        """Per group, the entries of the request's hit (see the class rules): cached
        pool blocks, with tiers the hashes of blocks host memory holds, and
        ``loading`` when blocks the hit needs are being fetched from disk (the
        request should wait)."""
        if not self.enabled or request.needs_every_prompt_position:
            return PrefixHit([[] for _ in self.kinds], 0)
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.extra_keys,
                                     request.mm_spans)
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached: list[list[HitEntry]] = [[] for _ in self.kinds]
        hit, loading = max_blocks, False
        for group, kind in enumerate(self.kinds):
            if kind.keeps_every_block:  # full attention: the longest cached prefix, read up to its first miss
                limit, hit = hit, self._cached_run(hashes[:hit], group, cached[group])
                if self.tiers is not None and hit < limit:  # then the tiers' run
                    num_ready, waits = self.tiers.lookup(hashes[hit:limit], group)
                    cached[group] += hashes[hit:hit + num_ready]
                    hit, loading = hit + num_ready, loading or waits
        for group, kind in enumerate(self.kinds):
            if not kind.keeps_every_block:  # a sliding or chunked group: every block before the hit, misses as None
                cached[group] = [self.block_pool.get_cached_block(block_hash, group) for block_hash in hashes[:hit]]
        hit, waits = self._sliding_agreement(hashes, cached, hit)
        starts = [kind.num_released(hit * self.block_size, self.block_size) for kind in self.kinds]
        return PrefixHit([[None] * start + entries[start:hit] for start, entries in zip(starts, cached)],
                         hit * self.block_size, loading or waits)

    def _cached_run(self, hashes: list[BlockHash], group: int, into: list[HitEntry]) -> int:
        """Append ``group``'s cached blocks of ``hashes`` to ``into`` up to the first miss; how many."""
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash, group)
            if block is None:
                break
            into.append(block)
        return len(into)

    def _sliding_agreement(self, hashes: list[BlockHash], cached: list[list[HitEntry]],
                           hit: int) -> tuple[int, bool]:
        """The largest ``h <= hit`` at which every sliding or chunked group has the
        blocks a query at block ``h`` reads cached, and whether the request must wait
        for some of them to come from disk. A miss at block ``i`` rules out every
        ``h > i`` whose window or chunk reaches back to ``i`` (the first block read
        never moves back as ``h`` grows), so the search jumps to ``i``.
        With tiers, a sliding group's pool misses are looked up in them as its
        window reaches them (a lookup costs the windows walked, not the prompt):
        host memory's fill ``cached``, disk's count as cached once fetched."""
        on_disk: list[set[int]] = [set() for _ in self.kinds]
        asked = [hit] * len(self.kinds)  # each group's tiers were asked about its misses from here on
        while hit > 0:
            last_miss = -1
            for group, kind in enumerate(self.kinds):
                if kind.keeps_every_block:
                    continue
                start = kind.num_released(hit * self.block_size, self.block_size)
                if self.tiers is not None and start < asked[group]:
                    self._find_in_tiers(hashes, group, cached[group], on_disk[group], range(start, asked[group]))
                    asked[group] = start
                last_miss = max(last_miss, next((i for i in range(hit - 1, start - 1, -1)
                                                 if cached[group][i] is None and i not in on_disk[group]), -1))
            if last_miss < 0:
                break
            hit = last_miss
        waits = False
        for group, kind in enumerate(self.kinds):
            if on_disk[group]:  # asked again: a fetch may have landed (or failed) since
                start = kind.num_released(hit * self.block_size, self.block_size)
                wanted = [index for index in sorted(on_disk[group]) if start <= index < hit]
                places = self.tiers.find_each([hashes[index] for index in wanted], group)
                for index, where in zip(wanted, places):
                    if where == "host":
                        cached[group][index] = hashes[index]
                # Anything else leaves a hole: wait, and look up again next schedule.
                waits = waits or any(where != "host" for where in places)
                self.tiers.fetch_each([hashes[index] for index, where in zip(wanted, places) if where == "disk"], group)
        return hit, waits

    def _find_in_tiers(self, hashes: list[BlockHash], group: int, entries: list[HitEntry], on_disk: set[int],
                       indices: range) -> None:
        """Fill ``group``'s pool misses at ``indices`` with the hashes host memory
        holds, and note in ``on_disk`` those a disk fetch can bring."""
        misses = [index for index in indices if entries[index] is None]
        for index, where in zip(misses, self.tiers.find_each([hashes[index] for index in misses], group)):
            if where == "host":
                entries[index] = hashes[index]
            elif where == "disk":
                on_disk.add(index)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enabled:
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def load_from_tiers(self, block_hashes: list[BlockHash], group: int) -> list[KVCacheBlock]:
        """Fresh blocks into which the tiers load these blocks of ``group`` before the forward."""
        if not block_hashes:
            return []
        blocks = self.block_pool.get_new_blocks(len(block_hashes))
        for block, block_hash in zip(blocks, block_hashes):
            self.tiers.load(block_hash, block.block_id, group)
        return blocks

    def _offload(self, block: KVCacheBlock) -> None:
        parent, token_ids, images = block.origin or (None, None, ())
        self.tiers.offload(block.block_id, block.block_hash, parent, token_ids, block.cache_group, images)

    def register(self, request: Request, record: BlockTableRecord, num_tokens: int, group: int = 0) -> None:
        """Register the blocks of group ``group``'s table that the request's first
        ``num_tokens`` tokens fill."""
        if not self.enabled:
            return
        num_full = min(num_tokens // self.block_size, len(record.entries))
        if num_full <= record.num_registered:
            return
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.extra_keys,
                                     request.mm_spans)
        # Token ids and parents only for the events and tiers that announce blocks (group 0's).
        described = self.block_pool.events is not None and group == 0
        tokens, size = request.all_token_ids, self.block_size
        # Released entries hold no block to register (after a swap-in restarts from 0).
        for index in range(max(record.num_registered, record.num_released), num_full):
            parent = hashes[index - 1] if index else None
            block_tokens = tokens[index * size:(index + 1) * size] if described else ()
            block = record.entries[index]
            images = block_image_keys(index, size, request.mm_spans) if described else ()
            if self.block_pool.cache_block(block, hashes[index], parent, block_tokens, group, images) \
                    and self.tiers is not None:
                self.tiers.persist(block.block_id, hashes[index], parent, block_tokens or None, group, images)
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

    def take_tier_moves(self) -> BlockMovePlan:
        return self.tiers.take_moves() if self.tiers is not None else BlockMovePlan()

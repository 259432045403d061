"""The physical KV blocks, their reference counts and the free queue.

Pure Python bookkeeping: no tensors live here. A block id indexes the
per-layer KV tensors owned by the model runner.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.kv_events import MEDIUM_POOL, BlockRemoved, BlockStored, KVEventLog


class BlockOwner(Protocol):
    """Who a block's revivable contents belong to besides the prefix cache (a resident
    LoRA adapter's pages). The owner gives its eviction callback when it is made;
    the pool calls it once, when it reuses one of the owner's free blocks."""

    name: str

    def evicted(self, block: KVCacheBlock) -> None: ...


class KVCacheBlock:
    """One physical block of ``block_size`` token slots.

    ``ref_cnt`` counts the block tables that point at this block. ``block_hash``
    is set once the block is full and registered in the prefix cache; from then
    on its contents never change. The ``prev_free`` / ``next_free`` links belong
    to :class:`FreeBlockQueue` and are only meaningful while the block is free.
    ``origin`` (parent hash, token ids, image keys) is kept only while KV events are on:
    a tier that takes the block over announces it with them. ``owner`` is set
    while the block is a page of a resident LoRA adapter (``kv_managers.adapter_pages``).
    Only the pool sets ``owner`` (``take_run``) and clears it (``disown``).
    ``cache_group`` is the KV cache group whose prefix cache holds the hash: the
    same tokens in two groups are different K/V (``core.kv_groups``).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "cache_group", "origin", "prev_free", "next_free",
                 "owner")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.cache_group = 0
        self.origin: tuple[BlockHash | None, tuple[int, ...], tuple] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.owner: BlockOwner | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) ``popleft``, ``append`` and ``remove``.

    The order is the eviction order: blocks are taken from the front and
    returned to the back, so the front is always the least recently freed
    block. ``remove`` exists so a free block can be taken out of the middle in
    O(1) (a list ``remove`` would be O(n) on the allocation hot path).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels make every real block have both neighbours, so no branch
        # is needed for the ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free blocks left")
        self.remove(first)
        return first

    def append(self, block: KVCacheBlock) -> None:
        last: KVCacheBlock = self._tail.prev_free  # type: ignore[assignment]  # sentinel: never None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first: KVCacheBlock = self._head.next_free  # type: ignore[assignment]  # sentinel: never None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All physical blocks of the KV pool, and the prefix cache over them.

    A free block is either uncached (no hash) or cached (hash known, contents
    reusable, evictable). The free queue is also the LRU: allocation takes
    from its front, evicting a cached block's hash in O(1); blocks that never
    got a hash are returned to the front (reused first), cached ones to the
    back (evicted last, least recently freed first).

    Safety rules:
    - ``get_new_blocks`` is all-or-nothing: it raises before touching anything
      when fewer than ``n`` blocks are free, so callers check
      ``num_free_blocks`` first and never leave a half-made allocation.
    - A block is in the free queue exactly when its ``ref_cnt`` is 0; a block
      with ``ref_cnt`` > 0 is never evicted.
    - A hashed block is full and immutable; a (group, hash) key maps to at most
      one block. The key carries the KV cache group because the same tokens in
      two groups are different K/V.
    - ``on_evict`` sees an evicted block while it still holds its hash and its
      contents: the caller may copy it down a tier, but must do so before the
      block is written again (the tier moves of the same step).
    - With ``events``, every hash that enters or leaves the cache is recorded
      there (medium "GPU"), in order: the pool is the one source of pool events.
      Only group 0's blocks are announced (it covers every token whenever the
      model has a full-attention layer; a one-group model's events are as before).
    - A free block with an ``owner`` (a resident adapter's page) sits in the free
      queue like a cached block, LRU beside them; taking it tells the owner
      (``BlockOwner.evicted``) before the block is handed out.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[KVCacheBlock], None] | None = None,
                 events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[tuple[int, BlockHash], KVCacheBlock] = {}
        self.num_evictions = 0
        self.on_evict = on_evict
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._forget_contents(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _forget_contents(self, block: KVCacheBlock) -> None:
        """A free block is about to be reused: evict the prefix block it holds, or tell its owner."""
        if block.block_hash is not None:
            self._evict(block)
        elif block.owner is not None:
            block.owner.evicted(block)

    def take_run(self, n: int, owner: BlockOwner, align: int = 1,
                 avoid: Collection[int] = ()) -> list[KVCacheBlock] | None:
        """``n`` free blocks with consecutive ids (none in ``avoid``: a prefix hit about
        to be revived), the first a multiple of ``align``, each
        with one reference and owned by ``owner`` from the moment it is taken (no held
        block is ever seen without its owner), or None if no such run is free. Of the
        free runs, the one holding the fewest cached blocks and owned free blocks wins,
        the highest ids on a tie: allocation takes low ids first, so adapters and tails
        settle at the top of the pool, apart from the requests' blocks. Scans from the
        top and stops at the first free run that holds nothing of value (the best there
        is); O(num_blocks) at worst: for an adapter's page-in or a request's tails,
        not every step's allocation."""
        best: tuple[int, int] | None = None  # (valued blocks in the run, -start)
        free_in_run = valued = 0  # over the window [start, start + n)
        for start in range(self.num_blocks - 1, -1, -1):
            block = self.blocks[start]
            free_in_run = free_in_run + 1 if block.ref_cnt == 0 and start not in avoid else 0
            valued += block.block_hash is not None or block.owner is not None
            if start + n < self.num_blocks:
                gone = self.blocks[start + n]
                valued -= gone.block_hash is not None or gone.owner is not None
            if free_in_run >= n and start % align == 0 and (best is None or valued < best[0]):
                best = (valued, -start)
                if valued == 0:
                    break
        if best is None:
            return None
        run = self.blocks[-best[1]: -best[1] + n]
        for block in run:
            self.free_block_queue.remove(block)
            self._forget_contents(block)
            block.ref_cnt, block.owner = 1, owner
        return run

    def disown(self, blocks: Iterable[KVCacheBlock]) -> None:
        """The owner of ``blocks`` gives them up (it was evicted, or its adapter
        unloaded): they become plain blocks where they are, free ones staying at
        their place in the free queue."""
        for block in blocks:
            block.owner = None

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        if self.events is not None and block.cache_group == 0:
            self.events.append(BlockRemoved([block.block_hash], MEDIUM_POOL))
        self._forget_hash(block)
        self.num_evictions += 1

    def _forget_hash(self, block: KVCacheBlock) -> None:
        del self.cached_blocks[(block.cache_group, block.block_hash)]
        block.block_hash = block.origin = None
        block.cache_group = 0

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached_blocks.get((group, block_hash))

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, parent: BlockHash | None = None,
                    token_ids: Sequence[int] = (), group: int = 0, image_keys: tuple = ()) -> bool:
        """Register a full, in-use block of KV cache group ``group`` under its hash
        (``parent``: the previous block's hash, ``token_ids``: its tokens, ``image_keys``:
        the images it covers, for the events). If another block already holds that content it stays the cached
        one; this block stays unhashed. Returns whether this block became the cached one."""
        if block.block_hash is not None or (group, block_hash) in self.cached_blocks:
            return False
        block.block_hash, block.cache_group = block_hash, group
        self.cached_blocks[(group, block_hash)] = block
        if self.events is not None and group == 0:
            block.origin = (parent, tuple(token_ids), image_keys)
            self.events.append(BlockStored([block_hash], parent, list(token_ids), len(token_ids), MEDIUM_POOL,
                                           image_keys))
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, reviving cached free blocks out of
        the free queue (O(1) each)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free
        queue in the order given: cached ones and adapter pages at the back, others
        at the front."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None and block.owner is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody uses; returns how many were dropped.
        Blocks still in use keep their hashes."""
        dropped = [b for b in self.cached_blocks.values() if b.ref_cnt == 0]
        announced = [block.block_hash for block in dropped if block.cache_group == 0]
        if announced and self.events is not None:
            self.events.append(BlockRemoved(announced, MEDIUM_POOL))
        for block in dropped:
            self._forget_hash(block)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the free queue, the ref counts and the hash map disagree."""
        in_queue = set()
        for block in self.free_block_queue:
            if block.block_id in in_queue:
                raise RuntimeError(f"block {block.block_id} appears twice in the free queue")
            in_queue.add(block.block_id)
            if block.ref_cnt != 0:
                raise RuntimeError(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
        if len(in_queue) != self.num_free_blocks:
            raise RuntimeError(
                f"free queue holds {len(in_queue)} blocks but counts {self.num_free_blocks}"
            )
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} has negative ref_cnt")
            if block.ref_cnt == 0 and block.block_id not in in_queue:
                raise RuntimeError(f"block {block.block_id} has ref_cnt 0 but is not free (leak)")
            key = (block.cache_group, block.block_hash)
            if block.block_hash is not None and self.cached_blocks.get(key) is not block:
                raise RuntimeError(f"block {block.block_id} has a hash the cache does not map to it")
        for key, block in self.cached_blocks.items():
            if (block.cache_group, block.block_hash) != key:
                raise RuntimeError(f"the cache maps a hash to block {block.block_id}, which holds another")

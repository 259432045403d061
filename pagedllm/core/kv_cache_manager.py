"""Block tables: which physical blocks hold each request's tokens.

Token ``t`` of a request lives in slot
``block_table[t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks on demand and frees them when a request ends.

    Safety rules:
    - ``allocate_slots`` is all-or-nothing: it counts the blocks a step needs
      before mutating anything and returns None on shortfall, so the scheduler
      can preempt and retry without undoing a half-made allocation.
    - Block tables are append-only while a request lives; a block is taken only
      when the previous last block is full, so a table never holds more than
      ``ceil(num_tokens / block_size)`` blocks and waste per request is at most
      ``block_size - 1`` slots.
    - ``free`` releases tail-first, so (once prefix caching keeps freed blocks
      around) a shared prefix is evicted after the private tails that follow it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.peak_blocks_in_use = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_tokens_after_step: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens_after_step`` tokens.

        Returns the new block ids (possibly empty), or None if the pool is short;
        on None nothing was changed.
        """
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = self.num_blocks_for(num_tokens_after_step) - len(blocks)
        if num_new <= 0:
            return []
        if num_new > self.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request_id]
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first). Freeing an unknown request is a no-op,
        so every finish/abort/preempt path can call it unconditionally."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def check_invariants(self, num_tokens_of: dict[str, int] | None = None) -> None:
        """Raise ``RuntimeError`` on the first broken invariant.

        ``num_tokens_of`` maps live request ids to the number of tokens whose
        slots they hold; when given, each table's length is checked against it.
        """
        self.block_pool.check_invariants()
        references: dict[int, int] = {}
        for request_id, blocks in self.req_to_blocks.items():
            for block in blocks:
                references[block.block_id] = references.get(block.block_id, 0) + 1
            if num_tokens_of is not None:
                if request_id not in num_tokens_of:
                    raise RuntimeError(f"request {request_id!r} holds blocks but is not live")
                limit = self.num_blocks_for(num_tokens_of[request_id])
                if len(blocks) > limit:
                    raise RuntimeError(
                        f"request {request_id!r} holds {len(blocks)} blocks for "
                        f"{num_tokens_of[request_id]} tokens (at most {limit})"
                    )
        for block in self.block_pool.blocks:
            expected = references.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{expected} block tables point at it"
                )

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
      (including a copy-on-write block) before mutating anything and returns
      None on shortfall, so the scheduler can preempt and retry without undoing
      a half-made allocation.
    - Only a table's last block is ever written, and never while it is shared:
      writing into a block with ``ref_cnt > 1`` first replaces it by a copy.
      Reads never check sharing.
    - Block tables are append-only while a request lives; a block is taken only
      when the previous last block is full, so a table never holds more than
      ``ceil(num_tokens / block_size)`` blocks and waste per request is at most
      ``block_size - 1`` slots.
    - ``free`` releases tail-first, so (once prefix caching keeps freed blocks
      around) a shared prefix is evicted after the private tails that follow it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_block_sharing: bool = True) -> None:
        if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.peak_blocks_in_use = 0
        # False only for the no-sharing baseline of `pagedllm bench sharing`.
        self.enable_block_sharing = enable_block_sharing

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def reset_peak_blocks_in_use(self) -> None:
        """Start a new peak measurement from the blocks in use now."""
        self.peak_blocks_in_use = self.num_blocks_in_use

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Make room to write tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

        Grows the table with fresh blocks and, if the first token lands in a
        block shared with another table (a partly filled tail after a fork),
        replaces that entry by a private copy: copy-on-write. Returns the
        ``(src, dst)`` block copies the model runner must perform before the
        forward pass (at most one, whatever the sequence length), or None if
        the pool is short; on None nothing was changed.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        num_new_blocks = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(blocks))
        write_index = num_computed_tokens // self.block_size
        needs_copy = write_index < len(blocks) and blocks[write_index].ref_cnt > 1
        if num_new_blocks + needs_copy > self.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request_id, blocks)
        copies = []
        if needs_copy:
            shared = blocks[write_index]
            (private,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([shared])  # drops our reference only
            blocks[write_index] = private
            copies.append((shared.block_id, private.block_id))
        blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
        return copies

    def fork(self, parent_id: str, child_id: str) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the parent's block table.

        With block sharing (the normal case) the child points at the parent's
        blocks and each block's count goes up: no data moves, and a later write
        into a shared tail is copied on write. Without it (the benchmarks'
        baseline) the child gets private copies of every block, returned as
        ``(src, dst)`` copies, or None if the pool is short.
        """
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id!r} already has a block table")
        parent_blocks = self.req_to_blocks.get(parent_id, [])
        if self.enable_block_sharing:
            self.block_pool.share(parent_blocks)
            self.req_to_blocks[child_id] = list(parent_blocks)
            return []
        if len(parent_blocks) > self.num_free_blocks:
            return None
        child_blocks = self.block_pool.get_new_blocks(len(parent_blocks))
        self.req_to_blocks[child_id] = child_blocks
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks_in_use)
        return [(src.block_id, dst.block_id) for src, dst in zip(parent_blocks, child_blocks)]

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

"""Full attention's rules for its KV cache group (no torch): every query reads every earlier
token, so a table releases nothing while its request lives, holds a block per
``block_size`` tokens, and a prefix-cache hit needs every block before the hit point
(the longest cached prefix)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.utils import cdiv


@dataclass(frozen=True)
class FullAttention:
    """Full attention (Llama, Gemma's global layers)."""

    # A hit is the longest cached prefix: the prefix cache reads its run up to the first miss.
    keeps_every_block = True

    def first_position_read(self, position: int) -> int:
        """The first key position a query at ``position`` reads."""
        return 0

    def num_released(self, num_tokens: int, block_size: int) -> int:
        """Leading table entries no query from position ``num_tokens`` on reads: none."""
        return 0

    def most_blocks_held(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once: all of them."""
        return cdiv(num_tokens, block_size)

    def describe(self) -> str:
        return "full attention"

    def describe_reach(self) -> str:
        return "full attention"

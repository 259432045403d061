"""Chunked local attention's rules for its KV cache group (no torch; Llama 4's local layers,
vLLM's ChunkedLocalAttentionManager).

With chunk ``C`` a query at position ``p`` reads keys ``floor(p / C) * C <= j <= p``: the
sequence is cut into chunks of ``C`` tokens and each token sees only the earlier tokens of
its own chunk (Hugging Face's ``chunked_attention`` mask). Once the next token to compute
sits at ``p``, the blocks wholly before its chunk's start are released; a table holds about
``C / block_size`` blocks plus a step's (a query reads at most ``C`` keys, as a window of
``C`` does); a prefix-cache hit at ``h`` needs the blocks from ``h``'s chunk start to ``h``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.kv_managers.sliding_window import check_span, most_blocks_reading


@dataclass(frozen=True)
class ChunkedLocal:
    """Chunked local attention with chunks of ``chunk`` tokens."""

    chunk: int
    keeps_every_block = False

    def __post_init__(self) -> None:
        check_span(self.chunk, "an attention chunk")

    def first_position_read(self, position: int) -> int:
        return position // self.chunk * self.chunk

    def num_released(self, num_tokens: int, block_size: int) -> int:
        """Leading entries wholly before the chunk of a query at ``num_tokens``."""
        return self.first_position_read(num_tokens) // block_size

    def most_blocks_held(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return most_blocks_reading(self.chunk, num_tokens, block_size, max_step_tokens)

    def describe(self) -> str:
        return f"chunked local attention {self.chunk}"

    def describe_reach(self) -> str:
        return f"chunked local attention, for their chunk of {self.chunk} tokens"

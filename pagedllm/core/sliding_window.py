"""Which leading entries of a block table a sliding window no longer reads (no torch).

A layer with window ``W`` lets a query at position ``p`` see keys ``p - W < j <= p``
(Hugging Face's convention). Once the next token to compute sits at position
``p``, every later query sits at ``p`` or after, so a block whose last position is
``<= p - W`` is never read again by any layer, provided every layer slides with
the same ``W`` (``EngineConfig.scheduler_config`` decides that): the KV cache
manager then releases it (vLLM's SlidingWindowManager).
Models with a full-attention layer (Gemma's hybrid layout) keep every block.
"""

from __future__ import annotations


def num_out_of_window_blocks(num_computed_tokens: int, sliding_window: int | None, block_size: int) -> int:
    """Leading table entries no query from position ``num_computed_tokens`` on will read:
    block ``i`` qualifies when its last position ``(i + 1) * block_size - 1`` is
    ``<= num_computed_tokens - sliding_window``. None (full attention): none."""
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


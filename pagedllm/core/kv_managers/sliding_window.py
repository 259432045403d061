"""A sliding window's rules for its KV cache group (no torch; vLLM's SlidingWindowManager).

A query at position ``p`` reads keys ``p - W < j <= p`` (Hugging Face's convention). Once
the next token to compute sits at ``p``, every later query sits at ``p`` or after, so a block
whose last position is ``<= p - W`` is never read again and is released; a table holds about
``W / block_size`` blocks plus a step's, and a prefix-cache hit at ``h`` needs only the
blocks a query at ``h`` reads cached.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.utils import cdiv


def check_span(value: int, what: str) -> None:
    """ValueError unless a window's or chunk's ``value`` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")


def most_blocks_reading(span: int, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once when a query reads at
    most ``span`` keys ending at itself and no step computes more than ``max_step_tokens``
    (admission's bound). A step from position p first releases what the query at p no
    longer reads, then takes blocks up to p + max_step_tokens: the ``span - 1`` earlier
    tokens and the step's, across at most one more block boundary than they fill."""
    return min(cdiv(num_tokens, block_size), cdiv(span - 1 + max_step_tokens, block_size) + 1)


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding window of ``window`` tokens (Mistral, Gemma's local layers)."""

    window: int
    keeps_every_block = False

    def __post_init__(self) -> None:
        check_span(self.window, "a sliding window")

    def first_position_read(self, position: int) -> int:
        return max(0, position - self.window + 1)

    def num_released(self, num_tokens: int, block_size: int) -> int:
        """Leading entries behind the window of a query at ``num_tokens``: block ``i`` goes
        when its last position ``(i + 1) * block_size - 1`` is ``<= num_tokens - window``."""
        return self.first_position_read(num_tokens) // block_size

    def most_blocks_held(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return most_blocks_reading(self.window, num_tokens, block_size, max_step_tokens)

    def describe(self) -> str:
        return f"sliding window {self.window}"

    def describe_reach(self) -> str:
        return f"sliding window {self.window}, for their last {self.window} tokens"

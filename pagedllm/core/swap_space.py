"""Host swap space: block ids of a preallocated host pool, handed out and taken back.

Pure bookkeeping, like the device BlockPool: the bytes live in the model
runner's host store (``kv_tiers/host.py``, which the host tier shares).
"""

from __future__ import annotations


class SwapSpace:
    """Free list of host block ids. ``allocate`` is all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"swap space needs a non-negative block count, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, host_blocks: list[int]) -> None:
        self._free.extend(host_blocks)

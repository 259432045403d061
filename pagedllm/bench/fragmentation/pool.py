"""The KV pool both layouts share (``PoolSpec``) and one layout's allocator with the
replay's admission (``LayoutPool``): the engine's own allocators, through their public
face ``pagedllm.kv_layouts`` (prefix caching off)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv_layouts import CONTIGUOUS, KVLayoutPool
from pagedllm.utils import cdiv
RESERVATIONS = ("max", "pow2", "oracle")


@dataclass(frozen=True)
class PoolSpec:
    """The KV pool both layouts share, and how the contiguous layout reserves."""

    num_blocks: int
    block_size: int
    max_model_len: int
    reservation: str = "max"

    def __post_init__(self) -> None:
        if self.reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {self.reservation!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def reserved_tokens(self, total_len: int) -> int:
        """Slots a contiguous reservation takes for a request of final length ``total_len``."""
        if self.reservation == "max":
            return self.max_model_len
        if self.reservation == "pow2":
            return min(1 << (total_len - 1).bit_length(), self.max_model_len)
        return total_len

    def final_blocks(self, layout: str, total_len: int) -> int:
        """Blocks a request holds when it reaches its final length."""
        tokens = self.reserved_tokens(total_len) if layout == CONTIGUOUS else total_len
        return cdiv(tokens, self.block_size)

    def admission_blocks(self, layout: str, num_tokens: int, total_len: int) -> int:
        """Free blocks an admission with ``num_tokens`` tokens needs: contiguous reserves the
        whole run up front, paged only the blocks the tokens fill."""
        if layout == CONTIGUOUS:
            return self.final_blocks(layout, total_len)
        return cdiv(num_tokens, self.block_size)

    def fits(self, layout: str, total_len: int) -> bool:
        """False for a request the layout can never serve in this pool (rejected on arrival)."""
        return total_len <= self.max_model_len and self.final_blocks(layout, total_len) <= self.num_blocks


class LayoutPool:
    """One layout's allocator (``pagedllm.kv_layouts``, the engine's own), admitting a
    request with the reservation ``spec`` says."""

    def __init__(self, spec: PoolSpec, layout: str) -> None:
        self.spec = spec
        self.layout = layout
        self.manager = KVLayoutPool(layout, spec.num_blocks, spec.block_size)

    def admit(self, request_id: str, num_tokens: int, total_len: int) -> bool:
        # max reserves max_model_len for everyone; pow2 and oracle size each request apart.
        return self.manager.admit(request_id, num_tokens, self.spec.reserved_tokens(total_len))

    def grow(self, request_id: str, num_tokens: int) -> bool:
        return self.manager.grow(request_id, num_tokens)

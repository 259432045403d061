"""The tensor-parallel group a model shard computes in.

Passed explicitly to every layer that needs a collective (no module-global
state). With ``world_size == 1`` every collective is a no-op, so the same
model code runs unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(first, count) of this rank's share of ``total`` units (KV heads, MLP
        columns): as even as possible, the lower ranks taking one more when it
        does not divide (SmolLM2's 3 KV heads over 2 ranks: 2 and 1). Raises
        ``ValueError`` when some rank would get nothing."""
        if total < self.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.world_size} exceeds the model's {what} ({total}): every rank "
                "needs at least one; choose a smaller size"
            )
        base, extra = divmod(total, self.world_size)
        return self.rank * base + min(self.rank, extra), base + (1 if self.rank < extra else 0)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same values."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor


SINGLE = TensorParallelGroup()

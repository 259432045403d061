"""What every rank runs in one step, as tensors: its own module so that the
speculator and the draft model (``worker/spec_decode/``) name it without
importing the runner that builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.adapter_spec import AdapterLoad
from pagedllm.core.tier_index import TierMoves
from pagedllm.worker.block_moves import TailMoves


@dataclass
class StepInputs:
    """Everything a rank needs to run one step, and nothing about requests:
    what the driver broadcasts to tensor-parallel workers. Block moves run
    first, in this order (a block swapped out may be reused as a copy or
    swap-in target), then the forward when there are tokens."""

    swap_out: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    # int8 pools with full-precision tails (``pagedllm.worker.tail_slots``), after
    # the block moves, in this order: tails out to the host (slot, host block),
    # slot copies (src slot, dst slot), tails back in (host block, slot), then
    # slots filled from a block's int8 values (block, slot).
    tail_moves: TailMoves | None = None
    # The tiers below the pool (``core/tier_index.py``): the driver alone has them.
    tier_moves: TierMoves | None = None
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    metadata: AttentionMetadata | None = None
    # LoRA: adapters to read into their pages after the block moves, and the forward's
    # rows as runs (start row, end row, adapter name or None for the base).
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    adapter_runs: list[tuple[int, int, str | None]] = field(default_factory=list)

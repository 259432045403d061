"""What every rank runs in one step, as tensors: its own module so that the
speculator and the draft model (``worker/spec_decode/``) name it without
importing the runner that builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.block_moves import BlockMovePlan


@dataclass
class StepInputs:
    """Everything a rank needs to run one step, and nothing about requests:
    what the driver broadcasts to tensor-parallel workers. ``block_moves``
    (the scheduler's, with an int8 pool's tail moves added) run around the
    forward, which runs when there are tokens."""

    block_moves: BlockMovePlan = field(default_factory=BlockMovePlan)
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    metadata: AttentionMetadata | None = None
    # LoRA: the forward's rows as runs (start row, end row, adapter name or None for
    # the base); page-ins are ``block_moves``' ``AdapterLoad`` records.
    adapter_runs: list[tuple[int, int, str | None]] = field(default_factory=list)
    # Images: forward rows and the encoder rows that replace their token embeddings (None: no image this step).
    multimodal_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

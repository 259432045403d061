"""``GrammarBitmask``: the allowed next tokens of one step's guided rows, as the
engine hands them from the grammar state (``pagedllm.structured_output``) to the
runner (``pagedllm.worker``) beside the ``SchedulerOutput``.

It lives here, with the rest of the per-step data the runner receives, so that
neither side imports the other. The tensor is only named in annotations: core
never loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GrammarBitmask:
    """The allowed next tokens of one step's guided sample rows, keyed by the
    rows' sequence ids (``SampleRow.sequence_id``, so the rows of a sequence
    about to fork each have their own). What the engine hands the runner.

    The mask is packed as xgrammar fills it: bit ``t % 32`` of int32 word
    ``t // 32`` is 1 when token ``t`` is allowed."""

    sequence_ids: list[str]
    bitmask: torch.Tensor  # [len(sequence_ids), ceil(vocab / 32)] int32, on CPU

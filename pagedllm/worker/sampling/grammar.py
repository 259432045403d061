"""Step 0 of sampling (see ``pagedllm.worker.sampler``): the grammar mask of
guided rows, before penalties and temperature.

The mask arrives packed as xgrammar fills it: bit ``t % 32`` of int32 word
``t // 32`` is 1 when token ``t`` is allowed. Only the rows that carry one are
touched; a batch without guided rows never reaches this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr


@dataclass(frozen=True)
class GrammarBitmask:
    """The allowed next tokens of one step's guided sample rows, keyed by the
    rows' sequence ids (``SampleRow.sequence_id``, so the rows of a sequence
    about to fork each have their own). What the engine hands the runner."""

    sequence_ids: list[str]
    bitmask: torch.Tensor  # [len(sequence_ids), ceil(vocab / 32)] int32, on CPU


@dataclass(frozen=True)
class RowBitmask:
    """The same masks keyed by logits row: what the sampler applies."""

    rows: list[int]
    bitmask: torch.Tensor


def apply_grammar(logits: torch.Tensor, grammar: RowBitmask) -> torch.Tensor:
    """An fp32 copy of ``logits`` whose disallowed tokens in ``grammar.rows`` are
    -inf. The caller's tensor is never modified (the sampler's rule)."""
    masked = logits.to(torch.float32, copy=True)
    # xgrammar reads bitmask row i for logits row i, so the guided rows' masks go
    # to their rows of an all-allowed bitmask, and only those rows are visited.
    full = torch.full((masked.shape[0], grammar.bitmask.shape[1]), -1, dtype=torch.int32)
    full[grammar.rows] = grammar.bitmask
    xgr.apply_token_bitmask_inplace(masked, full.to(masked.device, non_blocking=True), vocab_size=masked.shape[1],
                                    indices=grammar.rows)
    return masked

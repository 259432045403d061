"""Step 0 of sampling (see ``pagedllm.worker.sampler``): the grammar mask of
guided rows, before penalties and temperature.

The mask arrives packed as xgrammar fills it: bit ``t % 32`` of int32 word
``t // 32`` is 1 when token ``t`` is allowed. Only the rows that carry one are
touched, in place: a row without a grammar is neither read nor copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowBitmask:
    """The masks of a ``GrammarBitmask`` (``pagedllm.core.grammar_bitmask``) keyed by
    logits row: what the sampler applies."""

    rows: list[int]
    bitmask: torch.Tensor


def mask_guided_rows(logits: torch.Tensor, grammar: RowBitmask) -> None:
    """Set to -inf, in place, every token a guided row's grammar does not allow.

    Safety rule: ``logits`` must be the caller's own tensor (the runner's fresh
    logits); rows not in ``grammar.rows`` are left exactly as they are.
    """
    import xgrammar as xgr  # loaded on first use: a run without grammars never pays its import

    bitmask = grammar.bitmask.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    for index, row in enumerate(grammar.rows):
        # One [1, vocab] view per row: xgrammar pairs bitmask row i with logits row i.
        xgr.apply_token_bitmask_inplace(logits[row : row + 1], bitmask[index : index + 1], vocab_size=vocab)

"""The runner's side of multimodal rotary positions (M-RoPE): a model whose rotary
positions are three numbers a token (time, height, width: Qwen2-VL's) gets them here.

The interface: a model that has ``mrope_prompt_positions(num_tokens, mm_features) ->
([3, num_tokens] positions, delta)`` (pure data, from the prompt's length and each image's
grid) is an M-RoPE model. The runner asks it once per sequence it learns (a new sequence, or
one resumed after preemption: the same answer, from the same prompt and images) and keeps the
answer with the sequence; each step then slices it for the step's spans, whatever they are
(a whole prompt, a chunk of it, the rest of it after a prefix-cache hit), and a token past the
prompt takes its index + delta. ``positions`` reaching the model are its rotary positions:
[tokens] when every token's three are equal (every step of a model without M-RoPE, whose
path this module never touches; an M-RoPE model's decode steps and text), else [3, tokens].

Safety rule: the [tokens] index of a token (its place in its sequence: KV slots, context
lengths, tails) is never replaced; only the tensor handed to the model's forward is, so the
pool's bookkeeping cannot depend on a model's rotary positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.worker.input_batch import CachedSequence

PromptPositions = Callable[[int, Any], tuple[np.ndarray, int]]


class MRopePositions:
    """One runner's: each sequence's prompt positions (``CachedSequence.mrope``) and the step's slices."""

    def __init__(self, prompt_positions: PromptPositions) -> None:
        self.prompt_positions = prompt_positions

    @classmethod
    def for_model(cls, model: Any) -> MRopePositions | None:
        """None for a model without M-RoPE (its steps' positions are left as they are)."""
        prompt_positions = getattr(model, "mrope_prompt_positions", None)
        return None if prompt_positions is None else cls(prompt_positions)

    def learn(self, sequence: CachedSequence) -> None:
        """Keep a sequence's prompt positions (None for a prompt without images: its positions
        are its indices, delta 0)."""
        sequence.mrope = (self.prompt_positions(len(sequence.prompt_token_ids), sequence.mm_features)
                          if sequence.mm_features else None)

    def step_positions(self, order: Sequence[ScheduledSequence], sequences: dict[str, CachedSequence],
                       indices: np.ndarray) -> np.ndarray:
        """The rotary positions of a step whose spans (``order``, back to back) have token
        ``indices``: [tokens] where every token's three are equal, else [3, tokens]. A new
        array: ``indices`` stay the step's own."""
        rotary: np.ndarray | None = None
        start = 0
        for scheduled in order:
            count = scheduled.num_scheduled_tokens
            prompt = sequences[scheduled.sequence_id].mrope
            if prompt is not None:
                if rotary is None:
                    rotary = np.repeat(indices[None, :], 3, axis=0)
                table, delta = prompt
                rotary[:, start:start + count] += delta
                first, last = scheduled.num_computed_tokens, min(scheduled.num_computed_tokens + count, table.shape[1])
                if first < last:  # the span's prompt tokens: the table's columns
                    rotary[:, start:start + last - first] = table[:, first:last]
            start += count
        if rotary is None:
            return indices
        return rotary[0].copy() if (rotary[0] == rotary[1]).all() and (rotary[0] == rotary[2]).all() else rotary

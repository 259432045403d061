"""The model runner's share of speculative decoding: verify the drafts a step
carried, and propose the next ones.

The runner hands over, per speculating sequence, its scheduled share, its
cached token history and the hidden-state row of the span's last token; the
span's last ``k + 1`` rows are the verification rows (the last known token,
then the ``k`` drafts). Results go into the step's ``ModelRunnerOutput``:
the closing token in ``sampled_token_ids`` (as for any sequence), the whole
yield in ``verified``, and the next proposals in ``proposed_draft_token_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.outputs import PositionLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.rejection import VerifiedTokens, verify_drafts
from pagedllm.worker.sampling.metadata import SamplingMetadata


class TokenHistory(Protocol):
    """What the speculator reads of the runner's copy of a sequence."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


class Speculator:
    """Verification and n-gram proposals for the runner.

    Safety rule: ``forget`` every sequence the runner forgets, before the
    step that may send it again (its history restarts from scratch).
    """

    def __init__(self, config: SpeculativeConfig, eos_token_ids: list[int]) -> None:
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_draft_tokens = 0  # verified drafts, over the speculator's life
        self.num_accepted_tokens = 0

    def forget(self, sequence_ids: Sequence[str]) -> None:
        for sequence_id in sequence_ids:
            self.proposer.forget(sequence_id)

    def verify(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        items: list[tuple[ScheduledSequence, TokenHistory, int]],
    ) -> dict[str, VerifiedTokens]:
        """Verify the drafts of ``(scheduled, history, last row)`` items in one
        logits pass; returns each sequence's accepted drafts and closing token."""
        if not items:
            return {}
        rows: list[int] = []
        metadata = SamplingMetadata([], [], [], [], [])
        for scheduled, history, last_row in items:
            drafts = scheduled.draft_token_ids
            (sample_row,) = scheduled.sample_rows  # speculating sequences never fork
            for j in range(len(drafts) + 1):
                rows.append(last_row - len(drafts) + j)
                metadata.params.append(history.sampling_params)
                metadata.seeds.append(sample_row.seed)
                metadata.output_positions.append(sample_row.output_position + j)
                metadata.prompt_token_ids.append(history.prompt_token_ids)
                metadata.output_token_ids.append(history.output_token_ids + drafts[:j] if j else history.output_token_ids)
        logits = compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        drafts = [scheduled.draft_token_ids for scheduled, _, _ in items]
        results = verify_drafts(logits, metadata, drafts, self.eos_token_ids)
        self.num_draft_tokens += sum(len(d) for d in drafts)
        self.num_accepted_tokens += sum(r.num_accepted for r in results)
        return {scheduled.sequence_id: result for (scheduled, _, _), result in zip(items, results)}

    def propose(
        self, items: list[tuple[ScheduledSequence, TokenHistory, list[int]]]
    ) -> dict[str, list[int]]:
        """Proposals for ``(scheduled, history, tokens this step yielded)`` items
        whose step asked for some (``num_draft_tokens``); sequences with no
        match get none."""
        proposals: dict[str, list[int]] = {}
        for scheduled, history, step_tokens in items:
            if scheduled.num_draft_tokens == 0:
                continue
            segments = (history.prompt_token_ids, history.output_token_ids, step_tokens)
            drafts = self.proposer.propose(scheduled.sequence_id, segments, scheduled.num_draft_tokens)
            if drafts:
                proposals[scheduled.sequence_id] = drafts
        return proposals


def closing_token(result: VerifiedTokens) -> tuple[int, float, PositionLogprobs | None]:
    """The token the target chose itself (after the accepted drafts), with its logprobs."""
    return result.token_ids[-1], result.logprobs[-1], result.position_logprobs[-1]

"""The model runner's share of speculative decoding: verify the drafts a step
carried, and propose the next ones.

The runner hands over, per speculating sequence, its scheduled share, its
cached token history and the hidden-state row of the span's last token; the
span's last ``k + 1`` rows are the verification rows (the last known token,
then the ``k`` drafts). Each sequence's yield (accepted drafts, then the
token the target chose) is its ``SampledTokens`` in the step's
``ModelRunnerOutput.sampled``, like any sample row's single token; the next
proposals go to ``proposed_draft_token_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.worker.sampling.metadata import SamplingMetadata
from pagedllm.worker.spec_decode.draft_model import DraftModel
from pagedllm.worker.spec_decode.draft_policy import DraftPolicy
from pagedllm.worker.spec_decode.ngram import NgramProposer
from pagedllm.worker.spec_decode.rejection import verify_drafts
from pagedllm.worker.step_inputs import StepInputs


class TokenHistory(Protocol):
    """What the speculator reads of the runner's copy of a sequence."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


class Speculator:
    """Verification and n-gram proposals for the runner.

    Safety rules: ``forget`` every sequence the runner forgets, before the
    step that may send it again (its history restarts from scratch); with a
    draft model, ``observe`` every step the target runs.
    """

    def __init__(self, config: SpeculativeConfig, eos_token_ids: list[int], draft: DraftModel | None = None) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("a draft_model speculative config needs its DraftModel, and only it")
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        # One proposer: the draft model, or prompt lookup.
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if draft is None else None
        self.draft = draft
        adaptive = self.ngram is not None and config.draft_policy == "adaptive"
        self.policy = DraftPolicy(config.num_speculative_tokens) if adaptive else None
        self.num_draft_tokens = 0  # verified drafts, over the speculator's life
        self.num_accepted_tokens = 0

    def observe(self, step: StepInputs) -> None:
        """The target ran ``step``: the draft model runs it too (its K/V must follow)."""
        if self.draft is not None:
            self.draft.observe(step)

    def forget(self, sequence_ids: Sequence[str]) -> None:
        if self.ngram is not None:
            for sequence_id in sequence_ids:
                self.ngram.forget(sequence_id)
        if self.policy is not None:
            for sequence_id in sequence_ids:
                self.policy.forget(sequence_id)

    def record_step(self, scheduled: Sequence[ScheduledSequence], seconds: float) -> None:
        """The runner's ``execute`` of ``scheduled`` took ``seconds``: decode
        steps (every span its last token plus its drafts) teach the draft
        policy what a row costs."""
        if self.policy is None or not scheduled:
            return
        if all(s.num_scheduled_tokens == 1 + len(s.draft_token_ids) for s in scheduled):
            self.policy.record_step(sum(s.num_scheduled_tokens for s in scheduled), seconds)

    def verify(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        items: list[tuple[ScheduledSequence, TokenHistory, int]],
    ) -> dict[str, SampledTokens]:
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
                # Row j follows drafts[:j]: penalties and min_tokens must see them.
                metadata.output_token_ids.append(history.output_token_ids + drafts[:j])
        logits = compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        drafts = [scheduled.draft_token_ids for scheduled, _, _ in items]
        results = verify_drafts(logits, metadata, drafts, self.eos_token_ids)
        self.num_draft_tokens += sum(len(d) for d in drafts)
        self.num_accepted_tokens += sum(r.num_accepted_drafts for r in results)
        if self.policy is not None:
            for (scheduled, _, _), result in zip(items, results):
                self.policy.record_verification(scheduled.sequence_id, result.num_accepted_drafts)
        return {scheduled.sequence_id: result for (scheduled, _, _), result in zip(items, results)}

    def propose(
        self, items: list[tuple[ScheduledSequence, TokenHistory, list[int], list[int]]], step_rows: int,
        step_sequences: int,
    ) -> dict[str, list[int]]:
        """Proposals for ``(scheduled, history, tokens this step yielded, block
        table)`` items whose step asked for some (``num_draft_tokens``);
        sequences with no match, or whose drafts would not pay for their rows
        (the adaptive policy; ``step_rows`` and ``step_sequences`` describe
        this step), get none."""
        items = [item for item in items if item[0].num_draft_tokens]
        if self.ngram is None:
            contexts = [
                (block_ids, len(history.prompt_token_ids) + len(history.output_token_ids) + len(tokens) - 1, tokens[-1])
                for _, history, tokens, block_ids in items
            ]
            drafted = self.draft.propose(contexts, [item[0].num_draft_tokens for item in items])
            return {item[0].sequence_id: drafts for item, drafts in zip(items, drafted)}
        proposals: dict[str, list[int]] = {}
        for scheduled, history, step_tokens, _ in items:
            segments = (history.prompt_token_ids, history.output_token_ids, step_tokens)
            drafts = self.ngram.propose(scheduled.sequence_id, segments, scheduled.num_draft_tokens)
            if drafts and (self.policy is None or self.policy.should_draft(
                    scheduled.sequence_id, len(drafts), step_rows, step_sequences)):
                proposals[scheduled.sequence_id] = drafts
        return proposals

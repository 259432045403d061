"""From a step's final hidden states to what the runner returns: one
``SampledTokens`` per sample row the scheduler chose (a single sampled token,
or a speculating sequence's accepted drafts and closing token), the next
drafts, and the logprobs of prompt tokens that asked for them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.core.grammar_bitmask import GrammarBitmask
from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler_output import SampleRow, ScheduledSequence
from pagedllm.outputs import PositionLogprobs
from pagedllm.worker.input_batch import CachedSequence, InputBatch
from pagedllm.worker.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.worker.sampling.grammar import RowBitmask
from pagedllm.worker.spec_decode.speculator import Speculator


class StepSampler:
    """The runner's sampling stage. ``order`` and ``last_rows`` describe the
    forward that produced ``hidden``: the scheduled sequences in row order and
    the row of each one's last token.

    Safety rule: the runner applies the step's ``SchedulerOutput`` to
    ``batch`` before it samples, so ``batch.sequences`` holds every scheduled
    sequence's tokens and parameters.
    """

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor], sampler: Sampler,
                 speculator: Speculator | None, batch: InputBatch, device: torch.device) -> None:
        self.compute_logits = compute_logits
        self.sampler = sampler
        self.speculator = speculator
        self.batch = batch
        self.device = device

    def sample(
        self, order: list[ScheduledSequence], last_rows: list[int], hidden: torch.Tensor,
        grammar: GrammarBitmask | None,
    ) -> tuple[dict[str, SampledTokens], dict[str, list[int]]]:
        """Each sample row's tokens, keyed by the row's sequence id (a sequence
        about to fork has one row per future sample over the same logits), and
        the drafts proposed for the next step. ``grammar`` masks the guided rows."""
        rows: list[int] = []
        sample_rows: list[SampleRow] = []
        sequences: list[CachedSequence] = []
        speculating = []
        for scheduled, last_row in zip(order, last_rows):
            sequence = self.batch.sequences[scheduled.sequence_id]
            if scheduled.draft_token_ids:
                speculating.append((scheduled, sequence, last_row))
                continue
            if sequence.pooling_params is not None:
                continue  # pooled instead (``worker/pooler.py``)
            for sample_row in scheduled.sample_rows:
                rows.append(last_row)
                sample_rows.append(sample_row)
                sequences.append(sequence)
        sampled = self._sample_rows(rows, sample_rows, sequences, hidden, grammar) if rows else {}
        if self.speculator is None:
            return sampled, {}
        sampled.update(self.speculator.verify(self.compute_logits, hidden, speculating))
        return sampled, self._propose(order, sampled)

    def _sample_rows(
        self,
        rows: list[int],
        sample_rows: list[SampleRow],
        sequences: list[CachedSequence],
        hidden: torch.Tensor,
        grammar: GrammarBitmask | None,
    ) -> dict[str, SampledTokens]:
        """One token per sample row, from the logits of hidden row ``rows[i]``."""
        logits = self.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])
        metadata = SamplingMetadata(
            params=[s.sampling_params for s in sequences],
            seeds=[row.seed for row in sample_rows],
            output_positions=[row.output_position for row in sample_rows],
            prompt_token_ids=[s.prompt_token_ids for s in sequences],
            output_token_ids=[s.output_token_ids for s in sequences],
        )
        row_grammar = None
        if grammar is not None:
            row_of = {row.sequence_id: i for i, row in enumerate(sample_rows)}
            row_grammar = RowBitmask([row_of[s] for s in grammar.sequence_ids], grammar.bitmask)
        result = self.sampler(logits, metadata, row_grammar)
        return {
            row.sequence_id: SampledTokens([result.sampled_token_ids[i]], [result.sampled_logprobs[i]],
                                           [result.logprobs[i]])
            for i, row in enumerate(sample_rows)
        }

    def _propose(self, order: list[ScheduledSequence], sampled: dict[str, SampledTokens]) -> dict[str, list[int]]:
        """Drafts for the sequences whose step asked for them, continuing from
        the tokens the step gave them."""
        yielded = [
            (scheduled, self.batch.sequences[sequence_id], sampled[sequence_id].token_ids,
             self.batch.block_ids(sequence_id))
            for scheduled in order
            if scheduled.num_draft_tokens and (sequence_id := scheduled.sequence_id) in sampled
        ]
        step_rows = sum(scheduled.num_scheduled_tokens for scheduled in order)
        return self.speculator.propose(yielded, step_rows, len(order))

    def prompt_logprobs(
        self, order: list[ScheduledSequence], last_rows: list[int], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """Logits at prompt position p score prompt token p + 1 (the first prompt
        token has no logprob). Only spans that cover prompt positions need them."""
        scored = {}
        for scheduled, last_row in zip(order, last_rows):
            sequence = self.batch.sequences[scheduled.sequence_id]
            k = sequence.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = scheduled.num_computed_tokens
            stop = min(start + scheduled.num_scheduled_tokens, len(sequence.prompt_token_ids) - 1)
            if stop <= start:
                continue
            first_row = last_row - scheduled.num_scheduled_tokens + 1
            logits = self.compute_logits(hidden[first_row : first_row + stop - start])
            targets = sequence.prompt_token_ids[start + 1 : stop + 1]
            scored[scheduled.sequence_id] = (start + 1, compute_prompt_logprobs(logits, targets, k))
        return scored

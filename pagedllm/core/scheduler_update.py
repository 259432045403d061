"""The scheduler's other half: applying a step's sampled tokens to its sequences
(advancing them, forking samples, appending tokens, finishing).

A mixin of ``Scheduler`` (``core/scheduler.py``), kept apart so that choosing a
step's batch and applying its outcome each read as one file.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.block_moves import CopyBlock
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence_group import Append, Decision, Fork
from pagedllm.core.speculation import advance_computed, keep_proposals


class StepUpdates:
    """``update_from_output`` and what it does to sequences; uses the ``Scheduler``'s state."""

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance the scheduled sequences by the tokens just computed, less the
        drafts the runner rejected (a sequence's own row got its accepted drafts
        then one token: ``core/speculation.py`` rolls the rest back), then carry
        out what each request's ``SequenceGroupPolicy`` decides from its rows'
        tokens: forks, appends (token-level stops finish sequences and free
        their blocks), finishes. Returns the sequence each sample row names,
        one per row (finished ones included)."""
        advanced = []
        sampled, proposed = runner_output.sampled, runner_output.proposed_draft_token_ids
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.sequence_id)
            if request is None:
                continue  # finished since it was scheduled
            own = sampled.get(request.request_id)
            advance_computed(request, scheduled, own.token_ids if own else [], self.kv_cache_manager,
                             self.runner_views)
            rows = scheduled.sample_rows
            if not rows:
                continue
            if request.pooling_params is not None:
                request.pooled = runner_output.pooled[request.request_id]
            forks = self._apply(request.group_policy.decide(request, rows, sampled))
            advanced += [forks.get(row.sequence_id, request) for row in rows]
            if not request.is_finished:
                keep_proposals(request, proposed.get(request.request_id), self.config.max_model_len)
        return advanced

    def _apply(self, decisions: list[Decision]) -> dict[str, Request]:
        """Carry out a policy's decisions in order; returns the forks made, by id."""
        forks: dict[str, Request] = {}
        for decision in decisions:
            if isinstance(decision, Fork):
                parent = self.requests[decision.parent_id]
                forks[decision.child_id] = self._fork(parent, decision.child_id, decision.sample_index, decision.seed)
            elif isinstance(decision, Append):
                self._append(self.requests[decision.sequence_id], decision.token_ids)
            else:
                self.finish_request(decision.sequence_id, decision.status)
        return forks

    def _append(self, request: Request, token_ids: Sequence[int]) -> None:
        """Append tokens until one stops (finishes) the request. Forked by now if
        it was to, it holds one place in max_num_seqs; its forks hold the others."""
        if request.status is RequestStatus.RUNNING:
            self.num_seats_in_use -= request.num_pending_samples - 1
        request.num_pending_samples = 1
        for token_id in token_ids:
            request.append_output_token(token_id)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
                return

    def _fork(self, parent: Request, child_id: str, sample_index: int, seed: int) -> Request:
        """Start a running sequence that shares ``parent``'s tokens and blocks (and
        its adapter's pin: the KV manager's ``fork``)."""
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        copies = self.kv_cache_manager.fork(parent.request_id, child_id)
        if copies is None:
            raise RuntimeError("the pool ran out of blocks while copying a fork (block sharing is off)")
        self._pending_moves.add_all(CopyBlock(copy.src, copy.dst) for copy in copies)
        child = parent.fork(child_id, sample_index, seed)
        self.requests[child_id] = child
        self._arrival_order[child_id] = self._arrival_order[parent.request_id]
        self.running.append(child)
        self._transition(child, RequestStatus.RUNNING, is_new=True)
        return child

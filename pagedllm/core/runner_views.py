"""What the model runner holds of each sequence, so a step sends only what changed."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.kv_interface import NULL_BLOCK_ID, BlockCopy, KVCacheManagerProtocol
from pagedllm.core.request import Request, child_request_id, child_seed
from pagedllm.core.scheduler_output import NewSequenceData, SampleRow, ScheduledSequence, SchedulerOutput


@dataclass
class _View:
    """The runner's copy of a sequence covers these many tokens and table
    entries (in every KV cache group), the first ``num_released[g]`` of them
    released by group ``g``'s sliding window."""

    num_tokens: int
    num_blocks: int
    num_released: list[int]
    # Set by a speculative rollback until the next step tells the runner.
    truncated_to: int | None = None


class RunnerViews:
    """Turns scheduled sequences into runner data (``NewSequenceData`` the first
    time, diffs after that) and tracks which sequences the runner must forget.

    Safety rule: the scheduler calls ``release`` whenever a sequence leaves the
    RUNNING status (finish, abort, preemption); its next scheduling then sends
    it whole again, because a recompute or swap-in rebuilds its block table.
    """

    def __init__(self, kv_cache_manager: KVCacheManagerProtocol) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._views: dict[str, _View] = {}
        self._released: list[str] = []

    def held_ids(self) -> set[str]:
        return set(self._views)

    def release(self, sequence_id: str) -> None:
        if self._views.pop(sequence_id, None) is not None:
            self._released.append(sequence_id)

    def take_released(self) -> list[str]:
        """The sequences released since the last call (the runner forgets them first)."""
        released, self._released = self._released, []
        return released

    def truncate(self, sequence_id: str, num_entries: int) -> None:
        """A speculative rollback cut the sequence's table to ``num_entries``."""
        view = self._views.get(sequence_id)
        if view is not None and num_entries < view.num_blocks:
            view.num_blocks = num_entries
            view.truncated_to = num_entries if view.truncated_to is None else min(view.truncated_to, num_entries)

    def add_scheduled(
        self,
        output: SchedulerOutput,
        request: Request,
        num_new: int,
        copies: list[BlockCopy],
        num_draft_tokens: int = 0,
    ) -> None:
        """Append the request's share of the step to ``output``: the whole
        sequence if the runner does not hold it, else what changed since. The
        span's last ``len(request.draft_token_ids)`` tokens are drafts to
        verify; ``num_draft_tokens`` are to be proposed after it."""
        kv = self.kv_cache_manager
        sequence_id = request.request_id
        scheduled = ScheduledSequence(sequence_id, request.num_computed_tokens, num_new,
                                      sample_rows=sample_rows(request, num_new),
                                      draft_token_ids=request.draft_token_ids,
                                      num_draft_tokens=num_draft_tokens)
        view = self._views.get(sequence_id)
        if view is None:
            block_ids = kv.get_block_ids(sequence_id)
            output.new_sequences.append(NewSequenceData(
                sequence_id, request.prompt_token_ids, list(request.output_token_ids), block_ids,
                request.sampling_params, None if request.lora is None else request.lora.name,
                request.pooling_params, request.mm_features,
            ))
            self._views[sequence_id] = _View(request.num_tokens, len(block_ids[0]), kv.num_released(sequence_id))
        else:
            scheduled.new_token_ids = request.all_token_ids[view.num_tokens :]
            scheduled.truncated_table_length, view.truncated_to = view.truncated_to, None
            new_block_ids = kv.get_block_ids(sequence_id, view.num_blocks)
            scheduled.new_block_ids = new_block_ids if new_block_ids[0] else []
            # A window released entries the runner holds (so its tables never
            # name a block they no longer own), and copy-on-write replaced some.
            released = kv.num_released(sequence_id)
            scheduled.replaced_blocks = [
                (group, index, NULL_BLOCK_ID)
                for group, (before, now) in enumerate(zip(view.num_released, released))
                for index in range(before, min(now, view.num_blocks))
            ]
            scheduled.replaced_blocks += [(c.group, c.table_index, c.dst) for c in copies
                                          if c.table_index < view.num_blocks]
            view.num_tokens = request.num_tokens
            view.num_blocks += len(new_block_ids[0])
            view.num_released = released
        output.scheduled.append(scheduled)


def sample_rows(request: Request, num_new: int) -> list[SampleRow]:
    """The rows to sample when ``num_new`` tokens reach the request's last known
    token, as many as its policy asks for: row 0 for the request itself, row
    ``i`` for the sample ``i`` it may fork into (ids and seeds are decided
    here, once)."""
    if request.num_computed_tokens + num_new - len(request.draft_token_ids) < request.num_tokens:
        return []
    count = request.group_policy.num_rows(request)
    position = request.num_output_tokens
    return [
        SampleRow(child_request_id(request.group_id, i) if i else request.request_id, child_seed(request.seed, i), position)
        for i in range(count)
    ]

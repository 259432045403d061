"""Continuous batching: which requests run this step, and how many tokens each.

One mechanism, no phases (as in vLLM v1): every request has ``num_tokens``
(prompt + generated) and ``num_computed_tokens`` (tokens whose K/V are in the
pool); each step hands out tokens so that computed catches up with total: a
fresh prompt, a prefill chunk, a decode step and a recompute are one thing here.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import TYPE_CHECKING

from pagedllm.core.block_moves import BlockMovePlan, CopyBlock
from pagedllm.core.kv_interface import BlockCopy, KVCacheManagerProtocol
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_views import RunnerViews
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.scheduler_invariants import check_scheduler
from pagedllm.core.scheduler_update import StepUpdates
from pagedllm.core.speculation import num_drafts_to_propose
from pagedllm.core.waiting_queue import WaitingQueue
from pagedllm.logger import init_logger

if TYPE_CHECKING:  # config imports core (its KV groups): core reads the config's types only
    from pagedllm.config.engine import SchedulerConfig

logger = init_logger(__name__)

# Statuses of sequences that wait off the device, in the waiting queue.
QUEUED_STATUSES = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED})


class Scheduler(StepUpdates):
    """Decides each step's batch under ``max_num_seqs`` and ``max_num_batched_tokens``.

    Rules:
    - Requests are ranked by arrival (``fcfs``) or by ``priority`` then
      arrival (``priority`` policy; lower value first). Running requests are
      served first, in rank order; leftover budget admits waiting ones.
    - When a running request cannot get a block, the worst-ranked running
      request (lowest priority, latest arrival) is preempted, repeatedly, until
      the request fits or it is itself the victim. ``recompute`` frees the
      victim's blocks (it re-prefills later); ``swap`` copies its private
      blocks to the host pool (shared ones stay resident) and falls back to
      recompute when the host pool is full. No request is admitted in a step
      whose decodes had to preempt.
    - Under the ``priority`` policy a waiting request with a strictly better
      priority than the worst running one preempts it when seats
      (``max_num_seqs``) or blocks are what keeps it waiting; equal priorities
      never preempt each other, so nothing ping-pongs.
    - A request under a LoRA adapter is admitted only with its adapter's pages:
      the KV manager pins them as part of ``admit`` / ``admit_swapped``, and
      one whose adapter cannot be paged in waits.
    - A prefill chunk is cut by the step's budget and ``long_prefill_token_threshold``;
      without chunked prefill a request is admitted only when its whole prompt fits.
    - Every status change goes through ``_transition``.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManagerProtocol) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        # Every live sequence (user requests and the sequences forked from them).
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = WaitingQueue(self._rank)
        self._arrival_order: dict[str, int] = {}
        self._arrival_counter = itertools.count()
        self._status_counts: Counter[RequestStatus] = Counter()
        # Places in max_num_seqs held by running sequences: one each, plus the
        # samples a request will fork into at its first sampled position
        # (num_pending_samples), so admissions in the meantime leave room.
        self.num_seats_in_use = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        # Copies owed by forks made after the last forward pass.
        self._pending_moves = BlockMovePlan()  # forks' copies made between steps
        self.runner_views = RunnerViews(kv_cache_manager)

    @property
    def num_waiting(self) -> int:
        return sum(self._status_counts[status] for status in QUEUED_STATUSES)

    @property
    def num_running(self) -> int:
        return self._status_counts[RequestStatus.RUNNING]

    @property
    def num_swapped(self) -> int:
        return self._status_counts[RequestStatus.SWAPPED]

    # ----------------------------------------------------------- lifecycle

    def _transition(self, request: Request, status: RequestStatus, *, is_new: bool = False) -> None:
        """The one place a sequence changes status. Keeps the per-status counts,
        the seats, the waiting queue's membership and the runner's view in step
        with it (a sequence leaving the device is released from the runner)."""
        if not is_new:
            previous = request.status
            self._status_counts[previous] -= 1
            if previous is RequestStatus.RUNNING:
                self.num_seats_in_use -= request.num_pending_samples
            if previous in QUEUED_STATUSES:
                self.waiting.discard(request)
        request.status = status
        if status is not RequestStatus.RUNNING:
            self.runner_views.release(request.request_id)
            request.draft_token_ids = []
        if status.is_finished:
            return
        self._status_counts[status] += 1
        if status is RequestStatus.RUNNING:
            self.num_seats_in_use += request.num_pending_samples
        if status in QUEUED_STATUSES:
            self.waiting.push(request)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = next(self._arrival_counter)
        self._transition(request, RequestStatus.WAITING, is_new=True)
        self.kv_cache_manager.prefetch(request)

    def _rank(self, request: Request) -> tuple[int, int, int]:
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, self._arrival_order[request.request_id], request.sample_index)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _chunk(self, request: Request, start: int, num_tokens: int, budget: int) -> int:
        """Tokens of the pending span from position ``start`` that fit in this step. A chunk
        never ends inside an image the model attends both ways (``Request.whole_spans``):
        it stops before the image, or, starting at or inside it, takes the rest of it
        whole when the budget holds that (past ``long_prefill_token_threshold`` if need
        be), else nothing this step."""
        threshold = self.config.long_prefill_token_threshold
        capped = min(num_tokens, threshold) if threshold is not None and num_tokens > 1 else num_tokens
        end = start + min(capped, budget)
        for image_start, image_end in request.whole_spans:
            if image_start < end < image_end:
                if image_start > start:
                    return image_start - start
                return image_end - start if image_end - start <= budget else 0
        return end - start

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(block_moves=self._pending_moves)
        self._pending_moves = BlockMovePlan()
        self.running = sorted((r for r in self.running if not r.is_finished), key=self._rank)
        if self.config.scheduling_policy == "priority":
            self._preempt_for_priority(output)
        budget = self.config.max_num_batched_tokens
        decodes_preempted = self._schedule_running(output, budget)
        budget -= output.total_num_scheduled_tokens
        if not decodes_preempted:
            self._schedule_waiting(output, budget)
        # Last: the runner forgets the sequences preempted just now, and moves what the allocations evicted.
        output.released_sequence_ids = self.runner_views.take_released()
        output.block_moves.extend(self.kv_cache_manager.take_tier_moves())
        output.block_moves.add_all(self.kv_cache_manager.take_adapter_loads())
        output.tails_taken, output.tails_returned = self.kv_cache_manager.take_tail_changes()
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> bool:
        """Give running requests their tokens; returns whether it had to preempt."""
        kv = self.kv_cache_manager
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_pending = request.num_tokens - request.num_computed_tokens
            num_new = self._chunk(request, request.num_computed_tokens, num_pending + len(request.draft_token_ids),
                                  budget)
            # Drafts the budget cuts off are dropped, not deferred.
            del request.draft_token_ids[max(0, num_new - num_pending) :]
            if num_new == 0:
                # Nothing to compute this step: its policy holds the last sampled token back
                # until the rest of its group catches up, or its next chunk is an image the
                # budget left does not hold whole.
                index += 1
                continue
            copies = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            while copies is None:
                # Victims come from the tail: lowest priority, latest arrival, and
                # not yet scheduled this step (scheduling walks from the head).
                victim = self.running.pop()
                self._preempt(victim, output)
                preempted = True
                if victim is request:
                    break
                copies = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if copies is None:
                break
            self._add_scheduled(output, request, num_new, copies)
            budget -= num_new
            index += 1
        return preempted

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while budget > 0:
            request = self.waiting.peek()
            # A request that will fork into n samples needs n places.
            if request is None or self.num_seats_in_use + request.num_pending_samples > self.config.max_num_seqs:
                return
            if request.status is RequestStatus.SWAPPED:
                admitted = self._admit_swapped(request, output, budget)
            else:
                admitted = self._admit_waiting(request, budget)
            if admitted is None:
                if self._recompute_swapped_if_stuck(output):
                    continue
                return
            num_new, copies = admitted
            self._transition(request, RequestStatus.RUNNING)
            self.running.append(request)
            self._add_scheduled(output, request, num_new, copies)
            budget -= num_new

    def _admit_swapped(self, request: Request, output: SchedulerOutput,
                       budget: int) -> tuple[int, list[BlockCopy]] | None:
        """Bring a swapped request's blocks (and adapter) back and allocate its next
        tokens, or None if they do not fit."""
        num_new = self._chunk(request, request.num_computed_tokens, request.num_tokens - request.num_computed_tokens,
                              budget)
        resumed = self.kv_cache_manager.admit_swapped(request, num_new) if num_new else None
        if resumed is None:
            return None
        moves, copies = resumed
        output.block_moves.add_all(moves)
        return num_new, copies

    def _admit_waiting(self, request: Request, budget: int) -> tuple[int, list[BlockCopy]] | None:
        """Start (or restart, after a recompute preemption) a request from its
        cached prefix, or None if its adapter, its first chunk or their blocks do
        not fit (the KV manager's ``admit``: all-or-nothing)."""
        def first_chunk(num_cached: int) -> int | None:
            remaining = request.num_tokens - num_cached
            if remaining > budget and not self.config.enable_chunked_prefill:
                return None
            return self._chunk(request, num_cached, remaining, budget) or None  # 0: an image does not fit yet

        admitted = self.kv_cache_manager.admit(request, first_chunk)
        if admitted is None:
            return None
        request.num_computed_tokens = admitted.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = admitted.num_computed_tokens
        return admitted.num_new_tokens, admitted.copies

    def _recompute_swapped_if_stuck(self, output: SchedulerOutput) -> bool:
        """When nothing runs and the waiting head does not fit, swapped requests
        may be what fills the pool (each keeps its references to shared blocks:
        a prefix, a forked parent's tail). Turn every swapped request into a
        recompute preemption, releasing those and its host blocks; returns
        whether any was."""
        if self.running or output.scheduled or not self.num_swapped:
            return False
        for request in self.waiting:
            if request.status is RequestStatus.SWAPPED:
                self._drop_kv(request)
                self._transition(request, RequestStatus.PREEMPTED)
        logger.info("no request could run: swapped requests fall back to recompute to release their blocks")
        return True

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int, copies: list[BlockCopy]) -> None:
        # Blocks holding draft tokens are never cached: the drafts may be rejected.
        num_known = request.num_computed_tokens + num_new - len(request.draft_token_ids)
        self.kv_cache_manager.cache_full_blocks(request, num_known)
        output.block_moves.add_all(CopyBlock(copy.src, copy.dst) for copy in copies)
        samples = num_known >= request.num_tokens
        num_drafts = num_drafts_to_propose(request, self.config.num_speculative_tokens, samples)
        self.runner_views.add_scheduled(output, request, num_new, copies, num_drafts)

    def _preempt_for_priority(self, output: SchedulerOutput) -> None:
        """Let a strictly more urgent waiting request displace the worst running one
        when seats or blocks are what keep it out."""
        kv = self.kv_cache_manager
        while self.running:
            head = self.waiting.peek()
            worst = self.running[-1]
            if head is None or head.priority >= worst.priority:
                return
            no_seat = self.num_seats_in_use + head.num_pending_samples > self.config.max_num_seqs
            first_chunk = self._chunk(head, head.num_computed_tokens, head.num_tokens - head.num_computed_tokens,
                                      self.config.max_num_batched_tokens)
            no_room = kv.num_blocks_to_start(head.num_computed_tokens + first_chunk) > kv.num_free_blocks
            if not (no_seat or no_room):
                return
            self.running.pop()
            self._preempt(worst, output)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Take a running request off the device: swap its private blocks out, or
        (recompute, and swap's fallback) drop its K/V and keep every token id."""
        kv = self.kv_cache_manager
        self.num_preemptions += 1
        request.num_preemptions += 1
        output.preempted_request_ids.append(request.request_id)
        usage = f"KV usage {kv.num_blocks - kv.num_free_blocks}/{kv.num_blocks} blocks"
        swapped = None
        # A policy that holds a sampled token back (``may_swap`` False) needs the
        # sequence to sample that position again after a preemption, which only
        # a recompute does.
        if self.config.preemption_mode == "swap" and request.group_policy.may_swap:
            swapped = kv.swap_out(request.request_id)
        if swapped is not None:
            output.block_moves.add_all(swapped)
            self._transition(request, RequestStatus.SWAPPED)
            detail = f"swap: {len(swapped)} blocks to host"
        else:
            detail = f"recompute: {request.num_computed_tokens} tokens to recompute"
            self._drop_kv(request)
            self._transition(request, RequestStatus.PREEMPTED)
        message = f"preempted request {request.request_id!r} ({detail}); {usage}"
        if self.num_preemptions == 1:
            logger.warning(
                "%s. The KV pool is saturated: a larger pool (kv_cache_memory / num_kv_blocks) or a lower "
                "max_num_seqs avoids preemption.", message
            )
        else:
            logger.info(message)

    def _drop_kv(self, request: Request) -> None:
        """Free the request's blocks; its tokens are recomputed when it runs again."""
        self.num_recomputed_tokens += request.num_computed_tokens
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a live request and free its blocks. Unknown or
        already-finished ids are ignored, so racing aborts are harmless."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        # A running request stays in the running list until the next schedule()
        # sweeps it out: O(1) here instead of a list remove.
        self._transition(request, status)
        self._arrival_order.pop(request_id, None)
        self.kv_cache_manager.free(request_id)
        return request

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the scheduler's counts, queues, runner views
        and the KV manager's tables disagree."""
        check_scheduler(self)

"""Continuous batching: which requests run this step, and how many tokens each.

One mechanism, no phases (as in vLLM v1): every request has ``num_tokens``
(prompt + generated) and ``num_computed_tokens`` (tokens whose K/V are in the
pool); each step hands out tokens so that computed catches up with total. A
fresh prompt, a prefill chunk, a decode step and a recompute after preemption
are the same thing seen from here.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus, child_request_id, child_seed
from pagedllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens
    ``all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens]``
    with K/V slots given by ``block_ids``."""

    request: Request
    num_scheduled_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last
        logits pick the next token (a partial prefill chunk samples nothing)."""
        req = self.request
        return req.num_computed_tokens + self.num_scheduled_tokens == req.num_tokens


@dataclass
class SchedulerOutput:
    """What the model runner executes this step.

    Safety rule: the runner treats the ``Request`` objects as read-only; only
    the scheduler mutates them, in ``update_from_output``. The runner performs
    the block moves in this order before the forward pass: ``swap_out``
    (device -> host), ``block_copies`` (device -> device), ``swap_in``
    (host -> device), because a block freed by a swap-out may be reused as a
    copy or swap-in destination in the same step.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # (src, dst) physical blocks to copy, in order (copy-on-write, and forks
    # when block sharing is off).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
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
    - A prefill chunk is cut by the step's budget (chunked prefill) and by
      ``long_prefill_token_threshold``; without chunked prefill a waiting
      request is admitted only when its whole prompt fits.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # Heap of (rank..., request). Finished waiting requests are left in
        # place and skipped when they reach the top (lazy deletion).
        self._waiting: list[tuple[int, int, int, int, Request]] = []
        self._arrival_order: dict[str, int] = {}
        self._arrival_counter = itertools.count()
        self.num_waiting = 0
        self.num_running = 0
        # Places in max_num_seqs held by running requests: one each, plus the
        # samples a request will fork into at its first sampled position
        # (num_pending_samples), so admissions in the meantime leave room.
        self.num_seats_in_use = 0
        # Breaks rank ties in the waiting heap (beams share group and index).
        self._push_counter = itertools.count()
        self.num_swapped = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        # Copies owed by forks made after the last forward pass.
        self._pending_copies: list[tuple[int, int]] = []

    # ----------------------------------------------------------------- queue

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = next(self._arrival_counter)
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (*self._rank(request), next(self._push_counter), request))
        self.num_waiting += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][-1].is_finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][-1] if self._waiting else None

    def _pop_waiting(self) -> None:
        heapq.heappop(self._waiting)
        self.num_waiting -= 1

    def _rank(self, request: Request) -> tuple[int, int, int]:
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, self._arrival_order[request.request_id], request.sample_index)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """Tokens of a pending span that fit in this step."""
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and num_tokens > 1:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(block_copies=self._pending_copies)
        self._pending_copies = []
        self.running = sorted((r for r in self.running if not r.is_finished), key=self._rank)
        if self.config.scheduling_policy == "priority":
            self._preempt_for_priority(output)
        budget = self.config.max_num_batched_tokens
        decodes_preempted = self._schedule_running(output, budget)
        budget -= output.total_num_scheduled_tokens
        if not decodes_preempted:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> bool:
        """Give running requests their tokens; returns whether it had to preempt."""
        kv = self.kv_cache_manager
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                # A beam waiting for its siblings: nothing to compute this step.
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
        kv = self.kv_cache_manager
        while budget > 0:
            request = self._peek_waiting()
            # A request that will fork into n samples needs n places.
            if request is None or self.num_seats_in_use + request.num_pending_samples > self.config.max_num_seqs:
                return
            if request.status is RequestStatus.SWAPPED:
                num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
                if kv.swap_in_cost(request.request_id, request.num_computed_tokens, num_new) > kv.num_free_blocks:
                    if self._recompute_swapped_if_stuck(output):
                        continue
                    return
                output.swap_in.extend(kv.swap_in(request.request_id))
                self.num_swapped -= 1
                copies = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            else:
                computed_blocks, num_cached = kv.get_computed_blocks(request)
                remaining = request.num_tokens - num_cached
                if remaining > budget and not self.config.enable_chunked_prefill:
                    return
                num_new = self._chunk(remaining, budget)
                copies = kv.allocate_slots(request.request_id, num_cached, num_new, computed_blocks)
                if copies is None:
                    if self._recompute_swapped_if_stuck(output):
                        continue
                    return
                kv.record_lookup(request.num_tokens, num_cached)
                request.num_computed_tokens = num_cached
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_cached
            self._pop_waiting()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.num_running += 1
            self.num_seats_in_use += request.num_pending_samples
            self._add_scheduled(output, request, num_new, copies)
            budget -= num_new

    def _recompute_swapped_if_stuck(self, output: SchedulerOutput) -> bool:
        """When nothing runs (so no block will be freed) and the waiting head
        does not fit, swapped requests may be what fills the pool: a swapped
        request keeps its references to blocks it shares (a prefix, a forked
        parent's tail), and together they can pin more than any one of them
        needs back. Turn every swapped request into a recompute preemption,
        releasing those references and its host blocks; returns whether any was."""
        if self.running or output.scheduled or not self.num_swapped:
            return False
        for *_, request in self._waiting:
            if request.status is RequestStatus.SWAPPED:
                self.kv_cache_manager.free(request.request_id)
                self.num_recomputed_tokens += request.num_computed_tokens
                request.num_computed_tokens = 0
                request.status = RequestStatus.PREEMPTED
                self.num_swapped -= 1
        logger.info("no request could run: swapped requests fall back to recompute to release their blocks")
        return True

    def _add_scheduled(
        self, output: SchedulerOutput, request: Request, num_new: int, copies: list[tuple[int, int]]
    ) -> None:
        kv = self.kv_cache_manager
        kv.cache_full_blocks(request, request.num_computed_tokens + num_new)
        output.block_copies.extend(copies)
        output.scheduled.append(ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id)))

    def _preempt_for_priority(self, output: SchedulerOutput) -> None:
        """Let a strictly more urgent waiting request displace the worst running one
        when seats or blocks are what keep it out."""
        kv = self.kv_cache_manager
        while self.running:
            head = self._peek_waiting()
            worst = self.running[-1]
            if head is None or head.priority >= worst.priority:
                return
            no_seat = self.num_seats_in_use + head.num_pending_samples > self.config.max_num_seqs
            first_chunk = self._chunk(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)
            no_room = kv.num_blocks_for(head.num_computed_tokens + first_chunk) > kv.num_free_blocks
            if not (no_seat or no_room):
                return
            self.running.pop()
            self._preempt(worst, output)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Take a running request off the device: swap its private blocks out, or
        (recompute, and swap's fallback) drop its K/V and keep every token id."""
        kv = self.kv_cache_manager
        self.num_running -= 1
        self.num_seats_in_use -= request.num_pending_samples
        self.num_preemptions += 1
        request.num_preemptions += 1
        output.preempted_request_ids.append(request.request_id)
        usage = f"KV usage {kv.num_blocks_in_use}/{kv.num_blocks} blocks"
        swapped = None
        # Beams are recomputed, never swapped: a beam parked for its siblings
        # must produce its next-token distribution again after a preemption
        # (beam_search drops the stale one), which only a recompute does.
        if self.config.preemption_mode == "swap" and not request.tokens_chosen_externally:
            swapped = kv.swap_out(request.request_id)
        if swapped is not None:
            output.swap_out.extend(swapped)
            request.status = RequestStatus.SWAPPED
            self.num_swapped += 1
            detail = f"swap: {len(swapped)} blocks to host"
        else:
            self.num_recomputed_tokens += request.num_computed_tokens
            detail = f"recompute: {request.num_computed_tokens} tokens to recompute"
            kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        self._push_waiting(request)
        message = f"preempted request {request.request_id!r} ({detail}); {usage}"
        if self.num_preemptions == 1:
            logger.warning(
                "%s. The KV pool is saturated: a larger pool (kv_cache_memory / num_kv_blocks) or a lower "
                "max_num_seqs avoids preemption.", message
            )
        else:
            logger.info(message)

    # ---------------------------------------------------------------- update

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance the scheduled requests by the tokens just computed and append
        the sampled ones. A request with ``num_pending_samples`` > 1 first forks
        into its samples (the sample of fork ``i`` is keyed by its child id).
        Returns the requests that got a new token, and the externally driven
        (beam search) ones that reached a sampling position; those that hit a
        stop condition are already finished and their blocks freed."""
        advanced = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            if request.request_id not in sampled_token_ids:
                continue
            if request.tokens_chosen_externally:
                advanced.append(request)
                continue
            # Fork before appending: every sample starts from the prompt alone.
            samples = [request] + [
                self.fork_request(request, child_request_id(request.group_id, i), i, child_seed(request.seed, i))
                for i in range(1, request.num_pending_samples)
            ]
            self.settle_samples(request)
            for sample in samples:
                self.append_token(sample, sampled_token_ids[sample.request_id])
                advanced.append(sample)
        return advanced

    def append_token(self, request: Request, token_id: int) -> None:
        """Append a generated token and finish the request if it must stop."""
        request.append_output_token(token_id)
        status = request.check_stop(self.config.max_model_len)
        if status is not None:
            self.finish_request(request.request_id, status)

    def fork_request(self, parent: Request, child_id: str, sample_index: int, seed: int) -> Request:
        """Start a running sequence that shares ``parent``'s tokens and blocks."""
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        copies = self.kv_cache_manager.fork(parent.request_id, child_id)
        if copies is None:
            raise RuntimeError("the pool ran out of blocks while copying a fork (block sharing is off)")
        self._pending_copies.extend(copies)
        child = parent.fork(child_id, sample_index, seed)
        self.requests[child_id] = child
        self._arrival_order[child_id] = self._arrival_order[parent.request_id]
        self.running.append(child)
        self.num_running += 1
        self.num_seats_in_use += 1
        return child

    def settle_samples(self, request: Request) -> None:
        """The request has forked into its samples (or beams): it now holds one
        place in max_num_seqs, its children hold the others."""
        if request.status is RequestStatus.RUNNING:
            self.num_seats_in_use -= request.num_pending_samples - 1
        request.num_pending_samples = 1

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a live request and free its blocks. Unknown or
        already-finished ids are ignored, so racing aborts are harmless."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED):
            self.num_waiting -= 1
            self.num_swapped -= request.status is RequestStatus.SWAPPED
        else:
            self.num_running -= 1
            self.num_seats_in_use -= request.num_pending_samples
        # The request stays in the heap / running list until the next
        # schedule() sweeps it out: O(1) here instead of a list remove.
        request.status = status
        self._arrival_order.pop(request_id, None)
        self.kv_cache_manager.free(request_id)
        return request

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the scheduler's view and the block tables disagree."""
        for request_id in self.kv_cache_manager.req_to_blocks:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                raise RuntimeError(f"request {request_id!r} holds blocks but is not running")
        for request_id in self.kv_cache_manager.swapped_tables:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.SWAPPED:
                raise RuntimeError(f"request {request_id!r} has swapped blocks but is not swapped out")
        self.kv_cache_manager.check_invariants(
            {request_id: request.num_tokens for request_id, request in self.requests.items()}
        )
        running = [r for r in self.running if not r.is_finished]
        if any(r.status is not RequestStatus.RUNNING for r in running):
            raise RuntimeError("a request in the running list is not RUNNING")
        if len(running) > self.config.max_num_seqs:
            raise RuntimeError(f"{len(running)} running requests exceed max_num_seqs")
        seats = sum(r.num_pending_samples for r in running)
        if seats != self.num_seats_in_use or seats > self.config.max_num_seqs:
            raise RuntimeError(
                f"running requests hold {seats} places (counted {self.num_seats_in_use}), max_num_seqs "
                f"{self.config.max_num_seqs}"
            )

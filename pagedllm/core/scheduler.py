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
    the scheduler mutates them, in ``update_from_output``.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # (src, dst) physical blocks to copy, in order, before the forward pass
    # (copy-on-write, and forks when block sharing is off).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step's batch under ``max_num_seqs`` and ``max_num_batched_tokens``.

    Rules:
    - Running requests are served first, in priority order (lower ``priority``
      value first, then earlier arrival); leftover budget admits waiting ones.
    - When a running request cannot get a block, the lowest-priority,
      latest-arrived running request is preempted (recompute: its blocks are
      freed and it re-prefills later), repeatedly, until the request fits or it
      is itself the victim. No new request is admitted in a step that preempted.
    - Without chunked prefill a waiting request is admitted only when its whole
      remaining prompt fits in the step's leftover budget.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # Heap of (priority, arrival order, request). Aborted waiting requests are
        # left in place and skipped when they reach the top (lazy deletion).
        self._waiting: list[tuple[int, int, Request]] = []
        self._arrival_order: dict[str, int] = {}
        self._arrival_counter = itertools.count()
        self.num_waiting = 0
        self.num_running = 0
        self.num_preemptions = 0
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
        order = self._arrival_order[request.request_id]
        heapq.heappush(self._waiting, (request.priority, order, request))
        self.num_waiting += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][2].is_finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    def _rank(self, request: Request) -> tuple[int, int, int]:
        return (request.priority, self._arrival_order[request.request_id], request.sample_index)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(block_copies=self._pending_copies)
        self._pending_copies = []
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        self.running = sorted((r for r in self.running if not r.is_finished), key=self._rank)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                # A beam waiting for its siblings: nothing to compute this step.
                index += 1
                continue
            copies = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            while copies is None:
                # Victims come from the tail: lowest priority, latest arrival, and
                # not yet scheduled this step (scheduling walks from the head).
                victim = self.running.pop()
                self.num_running -= 1
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
                copies = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if copies is None:
                break
            kv.cache_full_blocks(request, request.num_computed_tokens + num_new)
            output.block_copies.extend(copies)
            output.scheduled.append(
                ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id))
            )
            budget -= num_new
            index += 1

        if output.preempted_request_ids:
            return output

        while budget > 0:
            request = self._peek_waiting()
            # A request that will fork into n samples needs n places.
            if request is None or self.num_running + request.num_pending_samples > self.config.max_num_seqs:
                break
            computed_blocks, num_cached = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            copies = kv.allocate_slots(request.request_id, num_cached, num_new, computed_blocks)
            if copies is None:
                break
            heapq.heappop(self._waiting)
            self.num_waiting -= 1
            kv.record_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.num_running += 1
            kv.cache_full_blocks(request, num_cached + num_new)
            output.block_copies.extend(copies)
            output.scheduled.append(
                ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id))
            )
            budget -= num_new
        return output

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the K/V, keep every token id."""
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

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
            request.num_pending_samples = 1
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
        return child

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a live request and free its blocks. Unknown or
        already-finished ids are ignored, so racing aborts are harmless."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.num_waiting -= 1
        else:
            self.num_running -= 1
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
        self.kv_cache_manager.check_invariants(
            {request_id: request.num_tokens for request_id, request in self.requests.items()}
        )
        running = [r for r in self.running if not r.is_finished]
        if any(r.status is not RequestStatus.RUNNING for r in running):
            raise RuntimeError("a request in the running list is not RUNNING")
        if len(running) > self.config.max_num_seqs:
            raise RuntimeError(f"{len(running)} running requests exceed max_num_seqs")

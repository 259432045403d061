"""The scheduler's integrity check: its counts, queues and runner views, and
the KV manager's tables, against the live requests."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedllm.core.request import RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler


def check_scheduler(scheduler: Scheduler) -> None:
    """Raise ``RuntimeError`` on the first disagreement (between steps)."""
    requests = scheduler.requests
    running_ids = {rid for rid, r in requests.items() if r.status is RequestStatus.RUNNING}
    scheduler.kv_cache_manager.check_invariants(
        running={rid: requests[rid].num_tokens for rid in running_ids},
        swapped=[rid for rid, r in requests.items() if r.status is RequestStatus.SWAPPED],
    )
    if Counter(r.status for r in requests.values()) != +scheduler._status_counts:
        raise RuntimeError(f"status counts {dict(scheduler._status_counts)} disagree with the live requests")
    if len(scheduler.waiting) != scheduler.num_waiting:
        raise RuntimeError(f"{len(scheduler.waiting)} requests wait but {scheduler.num_waiting} are counted")
    running = [r for r in scheduler.running if not r.is_finished]
    if {r.request_id for r in running} != running_ids or len(running) != len(running_ids):
        raise RuntimeError("the running list and the RUNNING requests disagree")
    seats = sum(r.num_pending_samples for r in running)
    max_num_seqs = scheduler.config.max_num_seqs
    if seats != scheduler.num_seats_in_use or seats > max_num_seqs:
        raise RuntimeError(
            f"running requests hold {seats} places (counted {scheduler.num_seats_in_use}), max_num_seqs {max_num_seqs}"
        )
    if not scheduler.runner_views.held_ids() <= running_ids:
        raise RuntimeError("the runner still holds sequences that are not running")
    for request in requests.values():
        # Drafts follow the last token, so only a decoding sequence holds them.
        if request.draft_token_ids and request.num_computed_tokens != request.num_tokens - 1:
            raise RuntimeError(f"request {request.request_id!r} holds drafts but is not decoding")

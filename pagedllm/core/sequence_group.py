"""How a request's sequences turn a step's sampled rows into decisions.

Every request carries a ``SequenceGroupPolicy``, shared by the sequences it
forks into. The scheduler asks it how many rows to sample when the request
reaches its last known token, whether its sequences may be swapped out or
speculate, and, once the step's tokens are back, what to do with them:
``Fork`` a sequence, ``Append`` tokens to one, ``Finish`` one. The scheduler
carries the decisions out itself, in order, so seats, forked block tables,
stop conditions and status changes stay its own.

``SamplingPolicy`` (every request's default) appends what the runner sampled;
a policy that picks tokens itself lives outside ``core/`` and implements the
same protocol (the engine's beam search does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler_output import SampleRow

if TYPE_CHECKING:
    from pagedllm.core.request import Request, RequestStatus


@dataclass(frozen=True)
class Fork:
    """Start ``child_id`` as a running copy of ``parent_id``: its tokens, its
    computed state and its blocks (shared, copied on write)."""

    parent_id: str
    child_id: str
    sample_index: int
    seed: int


@dataclass(frozen=True)
class Append:
    """Append ``token_ids`` to the sequence in order; a token that meets a
    stop condition (EOS, stop ids, length) finishes it and drops the rest."""

    sequence_id: str
    token_ids: Sequence[int]


@dataclass(frozen=True)
class Finish:
    """Finish the sequence with ``status`` and free its blocks."""

    sequence_id: str
    status: RequestStatus


Decision = Fork | Append | Finish


class SequenceGroupPolicy(Protocol):
    """What the scheduler asks of a request's sequences.

    Safety rules: ``decide`` is called once per step for each sequence that
    has sample rows, after its computed tokens are counted; it may name any
    live sequence of the request's group, and its decisions are applied in
    order (a ``Fork`` must come before anything appended to its parent, so the
    child starts from the parent's tokens).
    """

    @property
    def may_swap(self) -> bool:
        """Whether a preempted sequence may be swapped out (else it is recomputed)."""
        ...

    @property
    def may_speculate(self) -> bool:
        """Whether the runner may propose drafts for the sequences."""
        ...

    def num_rows(self, request: Request) -> int:
        """Rows to sample when ``request`` reaches its last known token."""
        ...

    def decide(self, request: Request, rows: list[SampleRow], sampled: Mapping[str, SampledTokens]) -> list[Decision]:
        """Decisions for ``request``'s ``rows`` of this step, given every row's
        tokens (``sampled``, keyed by ``SampleRow.sequence_id``)."""
        ...


class SamplingPolicy:
    """Sampling, with ``n`` / ``best_of`` samples: every row's tokens go to
    the sequence the row names. At the first sampled position a request has a
    row per sample, and the rows beyond the first fork it (with the row's id
    and seed) before anything is appended."""

    may_swap = True
    may_speculate = True

    def num_rows(self, request: Request) -> int:
        return request.num_pending_samples

    def decide(self, request: Request, rows: list[SampleRow], sampled: Mapping[str, SampledTokens]) -> list[Decision]:
        forks: list[Decision] = [
            Fork(request.request_id, row.sequence_id, index, row.seed) for index, row in enumerate(rows[1:], start=1)
        ]
        return forks + [Append(row.sequence_id, sampled[row.sequence_id].token_ids) for row in rows]


# Stateless, so one instance serves every sampled request.
SAMPLING = SamplingPolicy()


class PoolingPolicy:
    """A pooling request: its one row (at its last prompt token) is pooled by
    the runner, not sampled, and ends it. It is never swapped (the runner's
    per-chunk states of an ``encode`` would not survive it: a recompute
    rebuilds them) and never speculates."""

    may_swap = False
    may_speculate = False

    def num_rows(self, request: Request) -> int:
        return 1

    def decide(self, request: Request, rows: list[SampleRow], sampled: Mapping[str, SampledTokens]) -> list[Decision]:
        from pagedllm.core.request import RequestStatus  # (request imports this module)

        return [Finish(request.request_id, RequestStatus.FINISHED_STOPPED)]


POOLING = PoolingPolicy()

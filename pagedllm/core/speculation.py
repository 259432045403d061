"""The scheduler's share of speculative decoding: which sequences speculate,
how many draft tokens fit, and the rollback of rejected ones.

A decoding sequence with drafts ``d1..dk`` is scheduled for ``1 + k`` tokens
(its last known token, then the drafts). The runner verifies them and
returns the sequence's one token list: the accepted prefix ``d1..da``, then
one token sampled after it, so the step yields ``a + 1`` tokens and the
length says what was accepted; the K/V of the ``k - a`` rejected drafts is
garbage, so ``num_computed_tokens`` stops after ``da`` and the table's blocks
past what that needs go back to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import ScheduledSequence

if TYPE_CHECKING:
    from pagedllm.core.kv_interface import KVCacheManagerProtocol
    from pagedllm.core.runner_views import RunnerViews


def draft_room(request: Request, max_model_len: int) -> int:
    """Most drafts the request can use next step: every accepted draft is an
    output token, and so is the token sampled after them."""
    return max(0, min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1)


def num_drafts_to_propose(request: Request, num_speculative_tokens: int, samples_this_step: bool) -> int:
    """How many tokens the runner should propose after this step for the
    request: none for a sequence that does not sample now, whose policy does
    not speculate, that is about to fork into samples (the samples speculate
    once forked), or whose output a grammar constrains."""
    if (
        num_speculative_tokens == 0
        or not samples_this_step
        or not request.group_policy.may_speculate
        or request.num_pending_samples > 1
        or request.sampling_params.structured_outputs is not None
    ):
        return 0
    return num_speculative_tokens


def num_rejected(draft_token_ids: list[int], step_token_ids: Sequence[int]) -> int:
    """Drafts of the step the runner rejected, given the tokens the sequence's
    own row got (the accepted drafts, then one more; none for a span that
    samples nothing); raises ``RuntimeError`` on an answer whose accepted part
    is not a prefix of the drafts (a runner bug)."""
    accepted = list(step_token_ids[:-1])
    if draft_token_ids[: len(accepted)] != accepted:
        raise RuntimeError(f"accepted tokens {accepted} are not a prefix of the drafts {draft_token_ids}")
    return len(draft_token_ids) - len(accepted)


def advance_computed(
    request: Request,
    scheduled: ScheduledSequence,
    step_token_ids: Sequence[int],
    kv_cache_manager: KVCacheManagerProtocol,
    runner_views: RunnerViews,
) -> None:
    """Count the step's computed tokens, less the rejected drafts (the runner
    accepted ``len(step_token_ids) - 1``), and give the table's blocks past
    what the rest needs back to the pool (the runner hears of the cut with the
    sequence's next step)."""
    rejected = num_rejected(scheduled.draft_token_ids, step_token_ids)
    request.num_computed_tokens += scheduled.num_scheduled_tokens - rejected
    if rejected:
        kept = kv_cache_manager.truncate(request.request_id, request.num_computed_tokens)
        runner_views.truncate(request.request_id, kept)


def keep_proposals(request: Request, proposed_token_ids: list[int] | None, max_model_len: int) -> None:
    """Hold the drafts the runner proposed for the request's next step, as many
    as it can use; none when it proposed none (the step's own drafts are spent:
    scheduled again they would sit at the wrong positions and be rejected)."""
    request.draft_token_ids = proposed_token_ids[: draft_room(request, max_model_len)] if proposed_token_ids else []

"""Verify draft tokens against the target model's own distribution.

A sequence that proposed drafts ``d1..dk`` gets ``k + 1`` logits rows: row
``j`` is the target's distribution ``p_j`` of the token after ``d1..dj``.
Walking ``j = 0, 1, ...``:

- a greedy row accepts ``d_{j+1}`` when it is the row's argmax (after the same
  penalties and token rules as the sampler), so greedy output is exactly the
  output without speculation;
- a random row accepts ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d))``
  and, on rejection, draws from ``max(0, p_j - q_j)`` renormalised (Leviathan
  et al., 2023), which keeps the output distributed exactly as ``p``. Prompt
  lookup proposes deterministically (``q_j`` is one-hot on the draft), so the
  test is ``u < p_j(d)`` and the residual is ``p_j`` without ``d``;
- the first rejected row ends the walk with its corrected token; if every
  draft is accepted the last row adds one more token (the bonus).

Randomness comes from the sampler's per-row exponential noise ``E`` (seeded by
the sequence's seed and the row's output position): the race ``argmax(p / E)``
draws from ``p``, and ``u = exp(-E_d)`` is the uniform of the test. The race
over the other tokens is independent of ``E_d``, so the residual draw is fair,
and a bonus token is the very token the sampler would have drawn there.
"""

from __future__ import annotations

import torch

from pagedllm.core.runner_output import SampledTokens
from pagedllm.outputs import PositionLogprobs
from pagedllm.worker.sampling.draw import exponential_noise, target_probs
from pagedllm.worker.sampling.logits_processing import process_logits
from pagedllm.worker.sampling.logprobs import position_logprobs
from pagedllm.worker.sampling.metadata import SamplingMetadata
from pagedllm.worker.sampling.rows import take_rows


def verify_drafts(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: list[list[int]],
    eos_token_ids: list[int],
) -> list[SampledTokens]:
    """``logits``: the raw target logits, ``len(drafts) + 1`` consecutive rows
    per sequence in the order of ``draft_token_ids``; ``metadata`` one entry
    per row, whose ``output_token_ids`` include the drafts before the row (so
    penalties and min_tokens see what the row conditions on)."""
    processed = process_logits(logits.float(), metadata, eos_token_ids)
    chosen = processed.argmax(dim=-1)
    drafted = torch.tensor([d for drafts in draft_token_ids for d in (*drafts, -1)], device=logits.device)
    accepted = chosen == drafted
    random_rows = [i for i, p in enumerate(metadata.params) if not p.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        race_tokens, race_accepts = _random_rows(processed, metadata, drafted, random_rows)
        chosen[index] = race_tokens
        accepted[index] = race_accepts
    return _walk(logits, metadata, draft_token_ids, chosen.tolist(), accepted.tolist())


def _random_rows(
    processed: torch.Tensor, metadata: SamplingMetadata, drafted: torch.Tensor, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per random row: whether its draft passes ``u < p(d)``, and the token the
    row yields if the walk stops there (the residual draw for a row with a
    draft, the plain draw for a sequence's last row)."""
    probs = target_probs(take_rows(processed, rows), [metadata.params[i] for i in rows])
    noise = exponential_noise(
        [metadata.seeds[i] for i in rows], [metadata.output_positions[i] for i in rows], probs.shape[1], probs.device
    )
    drafts = drafted[torch.tensor(rows, device=probs.device)]
    has_draft = drafts >= 0
    column = drafts.clamp_min(0)[:, None]
    # u = exp(-E_d) < p(d)  <=>  E_d > -log p(d)
    accepts = has_draft & (noise.gather(1, column).squeeze(1) > -probs.gather(1, column).squeeze(1).log())
    residual = probs.scatter(1, column, torch.where(has_draft[:, None], 0.0, probs.gather(1, column)))
    return (residual / noise).argmax(dim=-1), accepts


def _walk(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: list[list[int]],
    chosen: list[int],
    accepted: list[bool],
) -> list[SampledTokens]:
    """Each sequence's accepted prefix and its closing token, with their raw logprobs."""
    results: list[SampledTokens] = []
    used_rows: list[int] = []
    row = 0
    for drafts in draft_token_ids:
        first = row
        tokens: list[int] = []
        for draft in drafts:
            if not accepted[row]:
                break
            tokens.append(draft)
            row += 1
        tokens.append(chosen[row])
        used_rows += range(first, row + 1)
        results.append(SampledTokens(tokens, [], []))
        row = first + len(drafts) + 1
    _fill_logprobs(logits, metadata, used_rows, results)
    return results


def _fill_logprobs(
    logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int], results: list[SampledTokens]
) -> None:
    """Raw logprobs (log_softmax of the unprocessed logits, as the sampler
    reports them) of the tokens each result kept, row by row."""
    tokens = [t for result in results for t in result.token_ids]
    log_probs = torch.log_softmax(take_rows(logits, rows).float(), dim=-1)
    token_index = torch.tensor(tokens, device=logits.device)[:, None]
    values = log_probs.gather(1, token_index).squeeze(1).tolist()
    wanted = [i for i, row in enumerate(rows) if metadata.params[row].logprobs is not None]
    entries: list[PositionLogprobs | None] = [None] * len(rows)
    if wanted:
        num_top = [metadata.params[rows[i]].logprobs for i in wanted]
        computed = position_logprobs(take_rows(log_probs, wanted), token_index[wanted].squeeze(1), num_top)
        for i, entry in zip(wanted, computed):
            entries[i] = entry
            values[i] = entry[tokens[i]].logprob
    offset = 0
    for result in results:
        count = len(result.token_ids)
        result.logprobs = values[offset : offset + count]
        result.position_logprobs = entries[offset : offset + count]
        offset += count

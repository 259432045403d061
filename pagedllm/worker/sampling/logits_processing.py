"""Steps 1-3 of sampling (see ``pagedllm.worker.sampler``): the token rules
(allowed_token_ids, bad_words, logit_bias: ``token_rules``), penalties, then the
min_tokens mask, on the raw logits."""

from __future__ import annotations

import itertools
import math

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling.metadata import SamplingMetadata
from pagedllm.worker.sampling.rows import row_values
from pagedllm.worker.sampling.token_rules import apply_token_rules, uses_token_rules


def process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata, eos_token_ids: list[int]
) -> torch.Tensor:
    """Token rules, penalties, then the min_tokens mask, on a copy made only if
    some row needs one of them."""
    params = metadata.params
    rule_rows = [i for i, p in enumerate(params) if uses_token_rules(p)]
    penalty_rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    mask_rows, mask_cols = _min_tokens_mask(metadata, eos_token_ids, logits.shape[1])
    if not penalty_rows and not mask_rows and not rule_rows:
        return logits
    processed = logits.to(torch.float32, copy=True)  # penalties and masks always work in fp32
    device = logits.device
    if rule_rows:
        apply_token_rules(processed, rule_rows, params, metadata.output_token_ids)
    if penalty_rows:
        index = torch.tensor(penalty_rows, device=device)
        processed[index] = _penalize(
            processed[index],
            [params[i] for i in penalty_rows],
            [metadata.prompt_token_ids[i] for i in penalty_rows],
            [metadata.output_token_ids[i] for i in penalty_rows],
        )
    if mask_rows:
        rows = torch.tensor(mask_rows, device=device)
        processed[rows, torch.tensor(mask_cols, device=device)] = -math.inf
    return processed


def _penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's order), batched."""
    vocab = logits.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        # Prompt tokens count for the repetition penalty only.
        seen_ids = [prompt + output for prompt, output in zip(prompt_token_ids, output_token_ids)]
        seen = _token_counts(seen_ids, vocab, logits.device, dtype=torch.bool)
        repetition = row_values([p.repetition_penalty for p in params], logits)
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, scaled, logits)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        counts = _token_counts(output_token_ids, vocab, logits.device, dtype=logits.dtype)
        frequency = row_values([p.frequency_penalty for p in params], logits)
        presence = row_values([p.presence_penalty for p in params], logits)
        logits = logits - frequency * counts - presence * (counts > 0)
    return logits


def _token_counts(
    token_ids: list[list[int]], vocab: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[len(token_ids), vocab]: how often each id occurs in each list (or whether, for bool)."""
    counts = torch.zeros(len(token_ids), vocab, dtype=dtype, device=device)
    flat = list(itertools.chain.from_iterable(token_ids))
    if flat:
        rows = torch.repeat_interleave(
            torch.arange(len(token_ids), device=device),
            torch.tensor([len(ids) for ids in token_ids], device=device),
        )
        ids = torch.tensor(flat, device=device)
        ones = torch.ones(len(flat), dtype=dtype, device=device)
        # Only counts need accumulating; a bool mask just needs the writes.
        counts.index_put_((rows, ids), ones, accumulate=dtype != torch.bool)
    return counts


def _min_tokens_mask(
    metadata: SamplingMetadata, eos_token_ids: list[int], vocab: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to set to -inf: EOS and stop_token_ids of rows below min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (params, position) in enumerate(zip(metadata.params, metadata.output_positions)):
        if position >= params.min_tokens:
            continue
        # An id outside the logits can never be sampled, so there is nothing to mask.
        stop_ids = {t for t in (*eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab}
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    return rows, cols

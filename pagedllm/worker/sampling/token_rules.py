"""Per-request token rules, applied to the raw logits before the penalties (vLLM's
order): ``allowed_token_ids``, then ``bad_words``, then ``logit_bias``.

Only rows whose params set a rule are touched, so a batch without any pays one
scan of its params. The engine has checked every token id against the
vocabulary and tokenized the bad words (``SamplingParams.bad_words_token_ids``).
"""

from __future__ import annotations

import math

import torch

from pagedllm.sampling_params import SamplingParams


def uses_token_rules(params: SamplingParams) -> bool:
    """Whether a row's logits must go through ``apply_token_rules``."""
    return bool(params.allowed_token_ids or params.bad_words_token_ids or params.logit_bias)


def apply_token_rules(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], output_token_ids: list[list[int]]
) -> None:
    """Apply the rules of ``rows`` (indexes into ``params``, ``output_token_ids``
    and the rows of ``logits``) in place. ``logits`` must be the sampler's own
    fp32 copy: the caller's tensor is never written."""
    device = logits.device
    for row in rows:
        allowed = params[row].allowed_token_ids
        if allowed:
            index = torch.tensor(allowed, device=device)
            kept = logits[row, index]
            logits[row] = -math.inf
            logits[row, index] = kept
    banned_rows, banned_ids = _banned_tokens(rows, params, output_token_ids)
    if banned_rows:
        logits[torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)] = -math.inf
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    biases: list[float] = []
    for row in rows:
        for token_id, bias in (params[row].logit_bias or {}).items():
            bias_rows.append(row)
            bias_ids.append(token_id)
            biases.append(bias)
    if bias_rows:
        # Each (row, id) pair occurs once (dict keys), so no accumulation is needed.
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
        logits[index] += torch.tensor(biases, dtype=logits.dtype, device=device)


def _banned_tokens(
    rows: list[int], params: list[SamplingParams], output_token_ids: list[list[int]]
) -> tuple[list[int], list[int]]:
    """(rows, token ids) that bad_words forbid next: a word's last token, when the
    tokens before it are the last tokens of the output (vLLM's rule)."""
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row in rows:
        output = output_token_ids[row]
        for word in params[row].bad_words_token_ids or []:
            prefix = word[:-1]
            if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
                banned_rows.append(row)
                banned_ids.append(word[-1])
    return banned_rows, banned_ids

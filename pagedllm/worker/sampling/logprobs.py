"""Reported logprobs: ``log_softmax`` of the raw logits, with vLLM's ranks
(1 + the number of strictly greater logprobs, so tied tokens share a rank)."""

from __future__ import annotations

import torch

from pagedllm.outputs import Logprob, PositionLogprobs


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int], num_logprobs: int
) -> list[PositionLogprobs]:
    """Logprobs of prompt tokens: ``logits[i]`` predicts ``target_token_ids[i]``.

    Returns, per position, ``{target id: Logprob}`` plus the ``num_logprobs``
    most likely tokens, all from ``log_softmax(logits[i])``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(
            f"logits must be [len(target_token_ids)={len(target_token_ids)}, vocab], "
            f"got shape {tuple(logits.shape)}"
        )
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    if not target_token_ids:
        return []
    targets = torch.tensor(target_token_ids, device=logits.device)
    return position_logprobs(
        torch.log_softmax(logits.float(), dim=-1), targets, [num_logprobs] * len(target_token_ids)
    )


def position_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[PositionLogprobs]:
    """Per row: {token id: Logprob} for token_ids[row], then the num_top[row] most likely.

    The chosen token comes first; a top token equal to it is not repeated, so a
    row has num_top or num_top + 1 entries.
    """
    chosen = logprobs.gather(1, token_ids[:, None])
    chosen_ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)
    result: list[PositionLogprobs] = []
    for token, value, rank, values, ids, k in zip(
        token_ids.tolist(),
        chosen.squeeze(1).tolist(),
        chosen_ranks.tolist(),
        top_values.tolist(),
        top_ids.tolist(),
        num_top,
    ):
        entry: PositionLogprobs = {token: Logprob(logprob=value, rank=rank)}
        for top_id, top_value, top_rank in zip(ids[:k], values[:k], _descending_ranks(values[:k])):
            entry.setdefault(top_id, Logprob(logprob=top_value, rank=top_rank))
        result.append(entry)
    return result


def _descending_ranks(values: list[float]) -> list[int]:
    """Ranks of a list sorted in decreasing order: 1 + the number of strictly greater values."""
    ranks: list[int] = []
    for j, value in enumerate(values):
        ranks.append(ranks[-1] if j > 0 and value == values[j - 1] else j + 1)
    return ranks

"""Apply work to a subset of the batch's rows, and broadcast one value per row."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.sampling_params import SamplingParams


def filter_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    uses: Callable[[SamplingParams], bool],
    apply: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor],
) -> torch.Tensor:
    """Run ``apply`` on the rows whose params satisfy ``uses``; skip it if none do.

    Writes into ``logits``, which must be the sampler's own tensor.
    """
    rows = [i for i, p in enumerate(params) if uses(p)]
    if not rows:
        return logits
    if len(rows) == len(params):
        return apply(logits, params)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = apply(logits[index], [params[i] for i in rows])
    return logits


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tensor[rows]`` for increasing distinct ``rows``; the tensor itself (no copy)
    when that is every row, so read-only callers skip a gather."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows, device=tensor.device)]


def row_values(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """A [rows, 1] column on ``like``'s device, to broadcast one value per row."""
    return torch.tensor(values, device=like.device)[:, None]

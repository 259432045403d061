"""The sampler's inputs and outputs, one entry per logits row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.outputs import PositionLogprobs
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """One row per logits row to sample."""

    params: list[SamplingParams]
    # Effective seed of each request (the engine draws one when params.seed is None).
    seeds: list[int]
    # Index in the output of the token being sampled now (== len(output_token_ids[i])).
    output_positions: list[int]
    prompt_token_ids: list[list[int]]
    # Tokens generated so far by that sequence.
    output_token_ids: list[list[int]]


@dataclass
class SamplerOutput:
    """What one sampler call chose, one entry per logits row."""

    sampled_token_ids: list[int]
    # Logprob of each sampled token under the raw model distribution.
    sampled_logprobs: list[float]
    # None unless params.logprobs is not None: {sampled id: Logprob, + top-k ids}.
    logprobs: list[PositionLogprobs | None]


def check_batch(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Raise ValueError unless ``logits`` is 2-D with one row per metadata entry."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    lengths = {
        "params": len(metadata.params),
        "seeds": len(metadata.seeds),
        "output_positions": len(metadata.output_positions),
        "prompt_token_ids": len(metadata.prompt_token_ids),
        "output_token_ids": len(metadata.output_token_ids),
    }
    wrong = {name: n for name, n in lengths.items() if n != num_rows}
    if wrong:
        raise ValueError(
            f"SamplingMetadata lists must have one entry per logits row ({num_rows}), got {wrong}"
        )

"""What the model runner hands back each step: plain data, no tensors.

The runner -> scheduler half of the step contract (``scheduler_output.py`` is
the other half). Every consumer (scheduler, engine, output processor,
structured output, metrics) reads one shape: per sample row the scheduler
chose, the tokens it got this step, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.outputs import PositionLogprobs


@dataclass
class SampledTokens:
    """The tokens one sample row got this step, oldest first: one without
    speculation; with it, the drafts the runner accepted and then one token it
    chose itself (so ``len(token_ids) - 1`` drafts were accepted). Index ``i``
    of every list describes token ``i``: its raw logprob, and its top-k entry
    when the request asked for logprobs (else None)."""

    token_ids: list[int]
    logprobs: list[float]
    position_logprobs: list[PositionLogprobs | None]

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class PooledOutput:
    """What a pooling sequence returns when its last prompt token is computed:
    float32 numbers, C order, as bytes (plain data that any process boundary
    carries), of ``shape`` (``[D]`` for a vector, ``[T, H]`` for encode)."""

    data: bytes
    shape: tuple[int, ...]


def _no_timings() -> dict[str, float]:
    return {"input preparation": 0.0, "forward": 0.0, "sampling": 0.0}


@dataclass
class ModelRunnerOutput:
    """One step's results (vLLM v1's ``ModelRunnerOutput``).

    ``sampled`` has one entry per ``SampleRow`` the scheduler chose, keyed by
    the row's ``sequence_id`` (a sequence about to fork has one per future
    sample). ``proposed_draft_token_ids`` are the drafts the runner proposes
    for each speculating sequence's next step (vLLM's ``spec_token_ids``).
    ``prompt_logprobs`` maps a request id to the index in its prompt of the
    first token scored this step and those tokens' logprobs. ``pooled`` has
    one entry per pooling sequence whose sample row came this step (its
    prompt is done), keyed by its id, in place of a sampled token.
    """

    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    proposed_draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    pooled: dict[str, PooledOutput] = field(default_factory=dict)
    # Seconds per phase, and in total, of the runner's execute().
    timings: dict[str, float] = field(default_factory=_no_timings)
    elapsed_s: float = 0.0

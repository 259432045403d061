"""What the engine hands back to users (vLLM's shapes and field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (core imports this module and never torch)
    import torch


@dataclass
class Logprob:
    """Log-probability of one token, its rank among all tokens (1 = most likely)
    and its text once detokenized."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # When the latest token came: each gap to the next one is an inter-token latency.
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # tokens sampled for it so far, over all its sequences
    num_preemptions: int = 0  # times this request (all its sequences) was preempted


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end of ``generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    # Prompt tokens whose K/V came from the prefix cache (a multiple of block_size).
    num_cached_tokens: int = 0


@dataclass
class PoolingOutput:
    """A pooling request's raw result (vLLM's ``PoolingOutput``): a float32 tensor,
    ``[D]`` for a vector or probabilities, ``[T, H]`` for ``encode``."""

    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (raw logits with use_activation=False)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (vLLM's shape): ``outputs`` is a
    ``PoolingOutput`` from the engine (``LLM.encode``), an ``EmbeddingOutput``,
    ``ClassificationOutput`` or ``ScoringOutput`` from ``LLM.embed`` /
    ``classify`` / ``score`` (their ``*RequestOutput`` subclasses)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    # Prompt tokens whose K/V came from the prefix cache (0 for an encoder).
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``outputs`` is an ``EmbeddingOutput``."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """``outputs`` is a ``ClassificationOutput``."""


class ScoringRequestOutput(PoolingRequestOutput):
    """``outputs`` is a ``ScoringOutput``."""

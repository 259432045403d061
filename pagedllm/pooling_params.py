"""PoolingParams: what one pooling request returns (vLLM's field names).

A pooling request ends after its prompt: instead of sampled tokens it returns
one pooled vector (``embed``), class probabilities (``classify``), a relevance
score of a text pair (``score``) or the prompt's raw hidden states
(``encode``). Every field is validated here, so a bad value raises
``ValueError`` naming the field before the request reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

PoolingTask = Literal["embed", "classify", "score", "encode"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode")


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options.

    - ``task``: what to return (None: the one the API call names; ``LLM.embed``
      sets ``embed``).
    - ``dimensions``: keep the first ``dimensions`` numbers of an embedding
      (Matryoshka models), normalized again when ``normalize`` is on.
    - ``normalize``: L2-normalize an embedding (None: what the model's
      sentence-transformers folder says; True for a decoder embedder).
    - ``use_activation``: apply the classifier's activation (softmax over the
      labels, sigmoid for one label) to classify/score logits (None: yes).
    - ``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: the
      model's length); None: a longer prompt is an error.
    """

    task: PoolingTask | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")

    def with_task(self, task: PoolingTask) -> PoolingParams:
        """These params for ``task``; ``ValueError`` if they already name another task."""
        if self.task is not None and self.task != task:
            raise ValueError(f"these PoolingParams are for task {self.task!r}, not {task!r}")
        return replace(self, task=task)

"""The runner's pooling stage: a decoder's pooled output for each pooling
sequence whose prompt is done, from the final hidden states of the step.

A pooling sequence is scheduled like any prompt (chunks, prefix-cache hits,
preemption); its sample row, at the last prompt token, is pooled here instead
of sampled (``StepSampler`` skips it). What it returns (``PoolerSpec`` says
which tasks the loaded model serves):

- ``embed``: the last token's final hidden state (after the final norm),
  L2-normalized unless ``normalize`` is False (unset: the ``PoolerSpec``'s rule), its first ``dimensions`` numbers
  (normalized again after the cut).
- ``classify`` / ``score``: the classifier's logits at the last token: the
  ``score`` head of a ``*ForSequenceClassification`` checkpoint, or for a
  yes/no reranker ``logit(yes) - logit(no)`` from the LM head, one label
  (vLLM's ``classifier_from_token`` conversion: its sigmoid is
  ``softmax([logit_no, logit_yes])[1]``). Softmax over several labels,
  sigmoid for one; raw with ``use_activation=False``.
- ``encode``: every prompt token's final hidden state ``[T, H]``, collected
  chunk by chunk (the request never takes a prefix-cache hit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.config.pooling import PoolerSpec
from pagedllm.core.runner_output import PooledOutput
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.pooling_params import PoolingParams
from pagedllm.worker.input_batch import CachedSequence


def pooled_output(values: torch.Tensor) -> PooledOutput:
    """A float32 tensor as the plain data the runner returns."""
    host = values.detach().to("cpu", torch.float32).contiguous()
    return PooledOutput(host.numpy().tobytes(), tuple(host.shape))


def embedding_of(hidden: torch.Tensor, params: PoolingParams, normalize_by_default: bool = True) -> torch.Tensor:
    """One embedding from a pooled hidden state ``[H]`` (float32); ``normalize_by_default``:
    whether it is normalized when ``params.normalize`` is unset (the model's own rule)."""
    vector = hidden.float()
    normalize = normalize_by_default if params.normalize is None else params.normalize
    if normalize:
        vector = F.normalize(vector, dim=-1)
    if params.dimensions is not None:  # (the engine checked it against the hidden size)
        vector = vector[: params.dimensions]
        if normalize:
            vector = F.normalize(vector, dim=-1)
    return vector


def activated(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Class probabilities from one row of classifier logits (float32): softmax over
    several labels, sigmoid for one; the logits themselves with ``use_activation=False``."""
    logits = logits.float()
    if params.use_activation is False:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


class DecoderPooler:
    """Pools the sequences of a step that asked for it (see the module docstring).

    Safety rule: the runner applies the step's ``SchedulerOutput`` to its batch
    first, so ``sequences`` holds every scheduled sequence's pooling params."""

    def __init__(self, spec: PoolerSpec, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 sequences: dict[str, CachedSequence]) -> None:
        self.spec = spec
        self.compute_logits = compute_logits
        self.sequences = sequences

    def pool(self, order: list[ScheduledSequence], last_rows: list[int], hidden: torch.Tensor) -> dict[str, PooledOutput]:
        """The pooled outputs of the step's pooling sequences whose prompt it completes.
        Last-token results come to the host in one copy per kind (embeddings, logits)."""
        pooled: dict[str, PooledOutput] = {}
        last: dict[str, list[tuple[str, PoolingParams, int]]] = {"embed": [], "classify": []}
        for scheduled, last_row in zip(order, last_rows):
            sequence = self.sequences[scheduled.sequence_id]
            params = sequence.pooling_params
            if params is None:
                continue
            if params.task == "encode":
                first_row = last_row - scheduled.num_scheduled_tokens + 1
                # A copy: a decode-path row may live in a CUDA graph's reused output buffer.
                sequence.prompt_states.append(hidden[first_row : last_row + 1].to(torch.float32, copy=True))
            if not scheduled.sample_rows:
                continue  # a chunk short of the prompt's end
            if params.task == "encode":
                pooled[scheduled.sequence_id] = pooled_output(torch.cat(sequence.prompt_states))
                sequence.prompt_states = []
            else:  # classify and score read the same logits
                kind = "embed" if params.task == "embed" else "classify"
                last[kind].append((scheduled.sequence_id, params, last_row))
        embedding = functools.partial(embedding_of, normalize_by_default=self.spec.normalize)
        for kind, finish in (("embed", embedding), ("classify", activated)):
            if last[kind]:
                rows = hidden[torch.tensor([row for _, _, row in last[kind]], device=hidden.device)]
                values = (rows if kind == "embed" else self._classifier_logits(rows)).to("cpu", torch.float32)
                for (sequence_id, params, _), row_values in zip(last[kind], values):
                    pooled[sequence_id] = pooled_output(finish(row_values, params))
        return pooled

    def _classifier_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, num_labels]`` classifier logits of last-token hidden states."""
        logits = self.compute_logits(rows).float()
        if self.spec.classifier_token_ids is None:
            return logits  # the ``score`` head's own labels
        no, yes = self.spec.classifier_token_ids
        return (logits[:, yes] - logits[:, no]).unsqueeze(1)

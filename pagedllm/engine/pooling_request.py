"""Pooling requests in the engine: what a decoder pools (``pooler_spec_of``) and
the ``UserRequest`` kind of one pooling request (``PoolingState``).

A pooling request runs as one sequence under ``core.sequence_group.POOLING``:
scheduled like any prompt (chunks, prefix-cache hits, recompute preemption),
it finishes when its last prompt token is computed, with the runner's pooled
output (``worker/pooler.py``) in place of a sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from pagedllm.config.pooling import PoolerSpec, PoolingConfig
from pagedllm.core.request import Request
from pagedllm.core.runner_output import PooledOutput
from pagedllm.core.sequence_group import POOLING
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.model.shapes import classifier_labels_of
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from pagedllm.pooling.st_folder import decoder_st_settings
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# What a pooling request's one sequence carries as sampling settings: it never
# samples, and its prompt + this one token must fit the model (as any request's).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def pooler_spec_of(config: PoolingConfig, model_config: Any, tokenizer: Any,
                   model_path: str | None = None) -> PoolerSpec | None:
    """What the loaded decoder pools under ``config`` (None: a generative engine); an
    embedder's instruction prompts and normalization come from the sentence-transformers
    files of its folder, ``model_path``. ``ValueError`` saying what to change for a runner
    the checkpoint cannot be."""
    num_labels = classifier_labels_of(model_config)
    tokens = config.classifier_from_token
    runner = config.runner
    if runner == "auto":
        runner = "pooling" if num_labels is not None or tokens is not None else "generate"
    if runner == "generate":
        if num_labels is not None:
            raise ValueError("this checkpoint is a sequence classifier (no LM head): pass runner='pooling'")
        return None
    if num_labels is not None:
        return PoolerSpec(("classify", "score", "encode") if num_labels == 1 else ("classify", "encode"))
    if tokens is not None:
        return PoolerSpec(("classify", "score", "encode"), _token_ids(tokens, tokenizer))
    if config.convert == "classify":
        raise ValueError("convert='classify' of a generative checkpoint needs the tokens its label is read from: "
                         "hf_overrides={'classifier_from_token': ['no', 'yes']} (Qwen3-Reranker's recipe)")
    if model_path is None or not Path(model_path).is_dir():
        return PoolerSpec(("embed", "encode"))
    prompts, normalize = decoder_st_settings(Path(model_path))
    return PoolerSpec(("embed", "encode"), prompts=prompts, normalize=normalize)


def _token_ids(tokens: tuple[str, str], tokenizer: Any) -> tuple[int, int]:
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"hf_overrides classifier_from_token {token!r} is not one token of this tokenizer")
        ids.append(encoded[0])
    return ids[0], ids[1]


def check_pooling_params(params: PoolingParams, spec: PoolerSpec | None, hidden_size: int) -> None:
    """``ValueError`` saying what to change for a pooling request this engine cannot run."""
    if spec is None:
        raise ValueError("this engine generates text: pass runner='pooling' to LLM(...) for embed, classify, "
                         "score and encode requests")
    if params.task is None:
        raise ValueError(f"PoolingParams.task is not set; this model serves {', '.join(spec.tasks)}")
    if params.task not in spec.tasks:
        raise ValueError(f"this model does not support the {params.task!r} task; it serves {', '.join(spec.tasks)}")
    if params.dimensions is not None and params.dimensions > hidden_size:
        raise ValueError(f"dimensions {params.dimensions} exceeds the model's embedding size {hidden_size}")


@dataclass
class PoolingState:
    """One pooling request (a ``UserRequest``): it reports itself once, when done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # POOLING_SAMPLING (the stats read its max_tokens)
    metrics: RequestMetrics
    request: Request

    streams_tokens: ClassVar[bool] = False
    num_completions: ClassVar[int] = 1

    def live_sequence_ids(self) -> list[str]:
        return [self.request_id]

    def output_lengths(self) -> list[int]:
        return []

    def own_output(self, tokenizer: Any) -> PoolingRequestOutput | None:
        """The finished request's pooled output (a float32 tensor); None before."""
        pooled = self.request.pooled
        if pooled is None:
            return None
        self.metrics.num_preemptions = self.request.num_preemptions
        return pooling_output(self.request_id, pooled, self.prompt, self.prompt_token_ids,
                              self.request.num_cached_tokens, self.metrics)


def pooling_output(request_id: str, pooled: PooledOutput, prompt: str | None, prompt_token_ids: list[int],
                   num_cached_tokens: int, metrics: RequestMetrics) -> PoolingRequestOutput:
    """A finished pooling request's output: its pooled data as a float32 tensor."""
    data = torch.frombuffer(bytearray(pooled.data), dtype=torch.float32).reshape(pooled.shape)
    return PoolingRequestOutput(request_id, PoolingOutput(data), prompt_token_ids, num_cached_tokens=num_cached_tokens,
                                prompt=prompt, metrics=metrics)


def new_pooling_request(input_processor: InputProcessor, spec: PoolerSpec | None, hidden_size: int, request_id: str,
                        prompt: PromptType, params: PoolingParams, arrival_time: float | None, priority: int,
                        cache_salt: str | None) -> tuple[Request, PoolingState]:
    """A validated pooling request (``ValueError`` saying what to change) and its state."""
    check_pooling_params(params, spec, hidden_size)
    sampling = replace(POOLING_SAMPLING, truncate_prompt_tokens=params.truncate_prompt_tokens)
    request, prompt_text = input_processor.new_request(request_id, prompt, sampling, 1, arrival_time, priority,
                                                       cache_salt, group_policy=POOLING)
    request.pooling_params = params
    state = PoolingState(request_id, prompt_text, request.prompt_token_ids, POOLING_SAMPLING,
                         RequestMetrics(arrival_time=request.arrival_time), request)
    return request, state

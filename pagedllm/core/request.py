"""A request's token state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.core.block_hash import request_extra_keys
from pagedllm.core.sequence_group import SAMPLING, SequenceGroupPolicy
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import mix_seed

if TYPE_CHECKING:
    from pagedllm.core.adapter_spec import AdapterSpec
    from pagedllm.core.runner_output import PooledOutput
    from pagedllm.multimodal.inputs import MultiModalFeature


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM ``finish_reason`` string, or None while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
}


def child_request_id(group_id: str, index: int) -> str:
    """Id of sample ``index`` of a request (index 0 is the request itself)."""
    return group_id if index == 0 else f"{group_id}::{index}"


def child_seed(seed: int, index: int) -> int:
    """Seed of sample ``index``: the request's own for index 0, a well-mixed
    distinct one for the others, so n samples differ and stay reproducible."""
    return seed if index == 0 else mix_seed(seed, index)


class Request:
    """Token ids of one sequence and how many of them have K/V in the pool.

    The scheduler's one mechanism: ``num_computed_tokens`` chases
    ``num_tokens``. A fresh prompt, a prefill chunk and a decode step differ
    only in how far behind it is; a recompute preemption resets it to 0.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        seed: int = 0,
        num_samples: int = 1,
        group_id: str | None = None,
        sample_index: int = 0,
        cache_salt: str | None = None,
        group_policy: SequenceGroupPolicy = SAMPLING,
        lora: AdapterSpec | None = None,
        pooling_params: PoolingParams | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # The effective output limit: params.max_tokens, capped by max_model_len.
        self.max_tokens = max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # Randomness of output position i comes from (seed, i) only.
        self.seed = seed
        self.output_token_ids: list[int] = []
        # Prompt + output, appended in place so no step rebuilds it.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.lora = lora  # the LoRA adapter it runs under (None: the base model)
        # Prefix caching: what besides the tokens (and images) a block's identity covers
        # (salt, adapter), and the hashes of the full blocks so far.
        self.cache_salt = cache_salt
        self.extra_keys: tuple = (request_extra_keys(cache_salt, None) if lora is None else
                                  request_extra_keys(cache_salt, lora.name, lora.fingerprint))
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.mm_features = tuple(mm_features)  # images in the prompt (``mm_spans``)
        # Sharing: the request whose prompt this sequence shares, and its place among the samples.
        # ``num_pending_samples`` > 1: the first sampled position forks this sequence into that many
        # (parallel sampling); until then the request holds that many of max_num_seqs' places.
        self.group_id = group_id if group_id is not None else request_id
        self.sample_index = sample_index
        self.num_pending_samples = num_samples
        # How the step's sampled rows become forks, appended tokens and
        # finishes (``core/sequence_group.py``); shared with every fork.
        self.group_policy = group_policy
        # Speculative decoding: tokens proposed after the last one, to verify
        # in the next step (consumed by it; dropped by a preemption).
        self.draft_token_ids: list[int] = []
        # A pooling request ends when its prompt is computed, with ``pooled`` instead of a sampled token.
        self.pooling_params = pooling_params
        self.pooled: PooledOutput | None = None

    @property
    def mm_spans(self) -> tuple[tuple[int, int, str], ...]:
        """(offset, length, content hash) of each image: the block hashes' image keys."""
        return tuple(feature.span for feature in self.mm_features)

    @property
    def whole_spans(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of each image whose tokens the model attends both ways: a prefill
        chunk must not end inside one (its earlier tokens read its later ones)."""
        return tuple((f.placeholder.offset, f.placeholder.end) for f in self.mm_features if f.attends_both_ways)

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether every prompt token's output is read (prompt logprobs, encode):
        such a request computes its whole prompt, with no prefix-cache hit."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (pooling is not None and pooling.task == "encode")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, child_id: str, sample_index: int, seed: int) -> Request:
        """A new sequence with this one's tokens and computed state (no blocks:
        the caller forks the block table too)."""
        child = Request(
            child_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=self.max_tokens,
            arrival_time=self.arrival_time,
            priority=self.priority,
            seed=seed,
            group_id=self.group_id,
            sample_index=sample_index,
            cache_salt=self.cache_salt,
            group_policy=self.group_policy,
            lora=self.lora,
            mm_features=self.mm_features,
        )
        child.block_hashes = list(self.block_hashes)
        child.num_cached_tokens = self.num_cached_tokens
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last sampled token implies, or None to go on."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

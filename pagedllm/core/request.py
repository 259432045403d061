"""A request's token state as the scheduler sees it."""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
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

"""From what a caller passes to a validated ``Request``: tokenize, check the
prompt against the model and the pool, resolve the seed and the salt."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    """Builds requests; never touches the scheduler, so a rejected request
    changes nothing. Seeds of unseeded requests come from one generator seeded
    by the engine's ``seed``, so a run is reproducible as a whole."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        seed: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.scheduler_config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self._rng = random.Random(seed)

    def new_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        num_sequences: int,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
    ) -> tuple[Request, str | None]:
        """Build a validated Request (``ValueError``, naming what to change, on
        anything that could never run). ``cache_salt`` (argument, or a dict prompt's
        ``"cache_salt"`` key) isolates the request's prefix-cache blocks: only
        requests with the same salt share them."""
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'; set it or drop priority")
        prompt_text, token_ids = self._tokenize(prompt)
        max_tokens = self._validate(token_ids, params)
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if num_sequences > 1 and self.cache_config.kv_layout == "contiguous":
            raise ValueError("n > 1, best_of and beam search need kv_layout='paged' (contiguous cannot share blocks)")
        if num_sequences > self.scheduler_config.max_num_seqs:
            raise ValueError(
                f"{num_sequences} parallel sequences (n / best_of / beam_width) exceed max_num_seqs "
                f"({self.scheduler_config.max_num_seqs}); lower them or raise max_num_seqs"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time,
            priority=priority,
            seed=seed,
            num_samples=num_sequences,
            cache_salt=cache_salt,
        )
        return request, prompt_text

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; pass at least one character or token id")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return self._tokenize(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' (token ids) or 'prompt' (text)")
        if isinstance(prompt, Sequence):
            return None, self._token_list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _token_list(self, token_ids: Sequence[Any]) -> list[int]:
        if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check the prompt against the model and the pool; return the effective max_tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); pass at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        prompt_len = len(token_ids)
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but max_model_len is {self.max_model_len} "
                f"(prompt + at least one generated token must fit); shorten the prompt or raise max_model_len"
            )
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        reservation = self.cache_config.contiguous_reservation
        if (
            self.cache_config.kv_layout == "contiguous"
            and isinstance(reservation, int)
            and prompt_len + max_tokens > reservation
        ):
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the contiguous reservation of "
                f"{reservation} tokens; lower max_tokens or raise contiguous_reservation"
            )
        needed = cdiv(prompt_len + max_tokens, self.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks but the "
                f"whole pool has {self.num_blocks}; lower max_tokens or enlarge the pool (kv_cache_memory / num_kv_blocks)"
            )
        return max_tokens

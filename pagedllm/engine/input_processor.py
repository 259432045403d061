"""From what a caller passes to a validated ``Request``: tokenize (and truncate)
the prompt, check it against the model and the pool, check the token ids the
sampling rules name against the vocabulary, tokenize ``bad_words``, resolve the
seed and the salt."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

from pagedllm.config.engine import CacheConfig, SchedulerConfig
from pagedllm.core.adapter_spec import AdapterSpec
from pagedllm.core.request import Request
from pagedllm.lora.registry import AdapterRegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.processing import ImagePromptProcessor
from pagedllm.core.sequence_group import SAMPLING, SequenceGroupPolicy
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
        max_logprobs: int = 20,
        adapters: AdapterRegistry | None = None,
        tail_blocks: int = 0,
        multimodal: ImagePromptProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.multimodal = multimodal  # a vision-language model's prompt processor (None: text only)
        self.num_images = 0  # images in the prompts of the requests built (stats' mm_images_processed)
        self.adapters = adapters
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.scheduler_config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.tail_blocks = tail_blocks  # an int8 request's full-precision tails (``core/kv_managers/tail_runs.py``)
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
        group_policy: SequenceGroupPolicy = SAMPLING,
        lora_request: LoRARequest | None = None,
    ) -> tuple[Request, str | None]:
        """Build a validated Request (``ValueError``, naming what to change, on
        anything that could never run). ``cache_salt`` (argument, or a dict prompt's
        ``"cache_salt"`` key) isolates the request's prefix-cache blocks: only
        requests with the same salt share them. ``group_policy`` turns its sampled
        rows into tokens (``core/sequence_group.py``; beam search passes its own).
        ``lora_request`` runs it under that adapter (checked here)."""
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'; set it or drop priority")
        lora = self._adapter(lora_request)
        prompt_text, token_ids, mm_features = self._prompt_inputs(prompt)
        self._check_images(mm_features, params)
        prompt_text, token_ids = self._truncate(prompt_text, token_ids, params.truncate_prompt_tokens)
        max_tokens = self._validate(token_ids, params, 0 if lora is None else lora.num_pages)
        params = self._with_token_rules(params)
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
            group_policy=group_policy,
            lora=lora,
            mm_features=mm_features,
        )
        self.num_images += len(mm_features)
        return request, prompt_text

    def _check_images(self, mm_features: list[MultiModalFeature], params: SamplingParams) -> None:
        if mm_features and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens would cut images out of the prompt; drop it for prompts "
                             "with multi_modal_data")
        both_ways = [f for f in mm_features if f.attends_both_ways]
        if both_ways and self.tail_blocks:  # (``torch_paged``'s tail rule attends in query chunks)
            raise ValueError("this model's images attend both ways, which an int8 KV pool with full-precision tails "
                             "does not take; start the engine with kv_cache_dtype='auto'")
        budget = self.scheduler_config.max_num_batched_tokens
        if any(f.placeholder.length > budget for f in both_ways):
            raise ValueError(f"an image spans more than max_num_batched_tokens ({budget}) tokens, and this model's "
                             "prefill chunks keep each image whole; raise max_num_batched_tokens")

    def _adapter(self, lora_request: LoRARequest | None) -> AdapterSpec | None:
        if lora_request is None:
            return None
        if self.adapters is None:
            raise ValueError(f"request names LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} but "
                             "the engine was started without LoRA; start it with enable_lora=True (--enable-lora)")
        return self.adapters.spec_for(lora_request)

    def _prompt_inputs(self, prompt: PromptType) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """Text, token ids and images of a prompt: a dict with ``multi_modal_data``
        (``{"image": PIL image or list}``, vLLM's shape) goes through the checkpoint's processor;
        one with ``mm_features`` was processed already (by the API process, ``processed``)."""
        images = isinstance(prompt, dict) and bool(prompt.get("multi_modal_data") or prompt.get("mm_features"))
        if not images:
            return (*self._tokenize(prompt), [])
        if self.multimodal is None:
            raise ValueError("this model takes text only; drop multi_modal_data or load a vision-language "
                             "checkpoint (Idefics3 / SmolVLM)")
        if prompt.get("multi_modal_data"):
            prompt = self.multimodal.processed(prompt)
        token_ids = self._token_list(prompt.get("prompt_token_ids") or [])
        return prompt.get("prompt"), token_ids, self.multimodal.check_features(token_ids, prompt["mm_features"])

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

    def check_logprobs(self, params: SamplingParams) -> None:
        """``ValueError`` when a request asks for more logprobs than ``max_logprobs`` (vLLM's limit)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"SamplingParams.{name} must be <= max_logprobs ({self.max_logprobs}), got {value}; "
                    "ask for fewer or start the engine with a larger max_logprobs"
                )

    def _truncate(self, prompt_text: str | None, token_ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """``truncate_prompt_tokens``: keep the last ``keep`` tokens (-1: the most the
        context allows with one token generated). A cut prompt's text is its
        tokens decoded, so the text and the ids always agree."""
        if keep is None:
            return prompt_text, token_ids
        if keep == -1:
            keep = self.max_model_len - 1
        if len(token_ids) <= keep:
            return prompt_text, token_ids
        token_ids = token_ids[-keep:]
        return self.tokenizer.decode(token_ids), token_ids

    def _with_token_rules(self, params: SamplingParams) -> SamplingParams:
        """Check the ids of logit_bias and allowed_token_ids against the vocabulary;
        return ``params``, or with bad_words a copy carrying their token ids (the
        caller's object is not changed: it may serve other prompts)."""
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if not params.bad_words:
            return params
        params = copy.copy(params)
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word as tokenized at the start of a text, and with a
        leading space when that makes a different first token but as many tokens
        (the same word in the middle of a text)."""
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        bad = [t for ids in sequences for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.bad_words tokenize to id {bad[0]}, outside the model's vocabulary")
        return sequences

    def _token_list(self, token_ids: Sequence[Any]) -> list[int]:
        if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams, adapter_pages: int = 0) -> int:
        """Check the prompt against the model and the pool (beside its adapter's pages);
        return the effective max_tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); pass at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        prompt_len = len(token_ids)
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but max_model_len is {self.max_model_len} "
                f"(prompt + at least one generated token must fit); shorten the prompt, pass "
                f"truncate_prompt_tokens (keep the last k tokens) or raise max_model_len"
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
        groups, tokens = self.scheduler_config.kv_groups, prompt_len + max_tokens
        # Over every KV cache group; a sliding group holds its window and a step, not the whole request.
        paged = self.cache_config.kv_layout == "paged"  # a contiguous run reserves every block
        needed = cdiv(tokens, self.block_size) if groups is None or not paged else groups.most_blocks_held(
            tokens, self.block_size, self.scheduler_config.max_num_batched_tokens)
        if needed + adapter_pages + self.tail_blocks > self.num_blocks:
            beside = [f"its LoRA adapter's {adapter_pages} pages"] if adapter_pages else []
            beside += [f"its full-precision tails' {self.tail_blocks} blocks"] if self.tail_blocks else []
            pages = f" beside {' and '.join(beside)}" if beside else ""
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks{pages} but the "
                f"whole pool has {self.num_blocks}; lower max_tokens or enlarge the pool (kv_cache_memory / num_kv_blocks)"
            )
        return max_tokens

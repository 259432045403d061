"""The offline ``LLM`` class: vLLM's user-facing shape over ``LLMEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import CacheConfig, EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

ChatMessages = list[dict[str, str]]


class LLM:
    """Generate text for a list of prompts with a paged-KV continuous-batching engine.

    ``model=None`` loads the embedded SmolLM2-135M-Instruct; otherwise pass a
    GGUF file or a Hugging Face checkpoint folder. The pool is sized by
    ``num_kv_blocks`` (exact), ``kv_cache_memory`` (bytes) or
    ``kv_cache_fraction`` (of available memory after weights), in that order.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float | None = None,
        num_kv_blocks: int | None = None,
        enable_block_sharing: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        debug_invariants: bool = False,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                kv_cache_fraction=kv_cache_fraction,
                num_kv_blocks=num_kv_blocks,
                enable_block_sharing=enable_block_sharing,
            ),
            debug_invariants=debug_invariants,
        )
        self.llm_engine = LLMEngine(config)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def stats(self) -> dict[str, int]:
        return self.llm_engine.stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A bad prompt raises ``ValueError`` before any step runs: the prompts
        already queued by this call are withdrawn, so nothing of it runs and no
        block stays taken.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; pass one or one per prompt"
                )
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priorities, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("this model has no chat template; pass chat_template=...")
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = [engine.next_request_id() for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, params, prio in zip(request_ids, prompts, params_list, priorities):
                engine.add_request(rid, prompt, params, priority=prio)
            with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        finally:
            # On any error (bad prompt midway, interrupt) nothing stays queued or holds blocks.
            engine.abort_request([rid for rid in request_ids if rid not in finished])
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or a list of them")
    return list(prompts)

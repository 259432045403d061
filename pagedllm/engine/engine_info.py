"""The facts about an engine that never change once it is built: what the
server reads without waiting for a step (``AsyncLLMEngine.info``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config.pooling import PoolerSpec
    from pagedllm.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineInfo:
    """Fixed at start-up, so any thread may read them while a step runs.

    Safety rule: ``tokenizer`` may be shared with the step thread (in-process),
    which decodes with it: readers only encode, decode and render chat templates,
    and never change its settings (truncation, padding, added tokens). With the
    engine core in its own process it is the API process's own copy.
    """

    tokenizer: Any
    max_model_len: int
    vocab_size: int  # the width of the logits: token ids at or above it are refused
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int  # most sequences in one step: bounds n and best_of
    max_logprobs: int
    scheduling_policy: str  # "fcfs" or "priority"
    # What a request leaves unset runs with (generation_config.json and --override-generation-config).
    default_sampling_params: Mapping[str, Any]
    pooler_spec: PoolerSpec | None = None  # what a pooling engine pools (None: it generates)
    # A vision-language model's ImagePromptProcessor (None: text only): images are processed in front of the engine.
    multimodal: Any = None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(
            tokenizer=engine.get_tokenizer(),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=tuple(engine.eos_token_ids),
            max_num_seqs=engine.scheduler_config.max_num_seqs,
            max_logprobs=engine.config.max_logprobs,
            scheduling_policy=engine.scheduler_config.scheduling_policy,
            default_sampling_params=MappingProxyType(dict(engine.default_sampling_params)),
            pooler_spec=engine.pooler_spec,
            multimodal=engine.input_processor.multimodal,
        )

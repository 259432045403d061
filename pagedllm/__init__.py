"""pagedllm: a readable LLM inference engine built around PagedAttention."""

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                              PoolingRequestOutput, RequestMetrics, RequestOutput, ScoringRequestOutput)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.version import __version__

__all__ = [
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "SamplingParams",
    "PoolingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "Logprob",
    "RequestMetrics",
    "EngineConfig",
    "CacheConfig",
    "SchedulerConfig",
]

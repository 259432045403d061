"""pagedllm: a readable LLM inference engine built around PagedAttention."""

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "EngineConfig",
    "CacheConfig",
    "SchedulerConfig",
]
__version__ = "0.1.0"

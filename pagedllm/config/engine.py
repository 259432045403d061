"""Engine configuration, validated when built.

Every check raises ``ValueError`` naming the option and what to change. Each
option is one field here with its help text in ``metadata["help"]``: ``LLM(...)``
takes the fields as keywords (``EngineConfig.from_options``) and the command
line generates one flag per field (``pagedllm/entrypoints/engine_args.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from pagedllm.config.cache import CacheConfig, check_choice
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.pooling import PoolingConfig
from pagedllm.config.multimodal import MultiModalConfig
from pagedllm.config.kv_offload import KVOffloadConfig
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.config.hybrid_kv import refuse_what_hybrid_groups_cannot_run
from pagedllm.core.kv_groups import KVGroupLayout, kv_group_layout

if TYPE_CHECKING:
    import torch

# The allowed values of the string options, read by the checks below and by the
# command line (as the flags' choices).
DType = Literal["float32", "bfloat16", "float16"]
# The dtype option: a DType, or auto (the checkpoint's own dtype, as vLLM's --dtype auto).
ModelDType = Literal["auto", "float32", "bfloat16", "float16"]
# Where requests' default sampling settings come from: auto (the checkpoint's
# generation_config.json, as vLLM) or vllm (vLLM's neutral defaults; the file is ignored).
GenerationConfigSource = Literal["auto", "vllm"]
# generation_config.json keys -> the SamplingParams fields they default (vLLM's --generation-config auto,
# and the keys --override-generation-config takes).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
GGUFWeights = Literal["packed", "dequantize"]

_DTYPES = get_args(DType)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``dtype`` option value (torch is imported only here,
    so the bookkeeping that reads this module stays torch-free)."""
    check_choice("dtype", name, DType)
    import torch

    return getattr(torch, name)


@dataclass
class SchedulerConfig:
    """Per-step budget of the continuous-batching scheduler.

    ``max_model_len`` is the model's context window (prompt + output);
    ``max_num_batched_tokens`` bounds the tokens of one forward pass and
    ``max_num_seqs`` the requests in it. Without chunked prefill a whole prompt
    must fit in one step, so ``max_num_batched_tokens >= max_model_len``.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"  # swap falls back to recompute when the swap space is full
    scheduling_policy: SchedulingPolicy = "fcfs"  # or "priority": lower `priority` value is served first
    # Most prompt tokens one request may prefill in one step (None: no cap), so a
    # huge prompt cannot stall everyone else's decoding.
    long_prefill_token_threshold: int | None = None
    # The model's KV cache groups (``core.kv_groups``): which layers share a block
    # table and how they attend; a sliding group releases the blocks behind its
    # window. None: one group of full-attention layers (every block is kept).
    kv_groups: KVGroupLayout | None = None
    # Speculative decoding: most draft tokens a decoding sequence verifies per
    # step (0: off). Drafts ride in the step's token budget.
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        check_choice("preemption_mode", self.preemption_mode, PreemptionMode)
        check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        threshold = self.long_prefill_token_threshold
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
                raise ValueError(f"long_prefill_token_threshold must be an integer >= 1 or None, got {threshold!r}")
            if not self.enable_chunked_prefill:
                raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}); raise it, lower max_model_len, or enable chunked prefill"
            )


@dataclass
class EngineConfig:
    """Everything ``LLMEngine`` needs. ``model=None`` is the embedded SmolLM2-135M-Instruct."""

    model: str | None = field(
        default=None,
        metadata={"help": "GGUF file or Hugging Face checkpoint folder (None: the embedded SmolLM2-135M-Instruct)"},
    )
    dtype: ModelDType = field(
        default="float32",
        metadata={"help": "dtype of the weights and activations; auto: the checkpoint's (config.json "
                          "torch_dtype / dtype; a GGUF file has none and gets float32)"},
    )
    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda or cuda:N (None: cuda when available, else cpu)"}
    )
    seed: int = field(default=0, metadata={"help": "seeds the per-request seeds of requests that set none"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "context window, prompt + output (None: the model's max_position_embeddings)"}
    )
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata={"help": "most tokens in one step (None: 2048, or max(2048, max_model_len) without chunked prefill)"},
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "split a prompt over steps when it does not fit the step's token budget"}
    )
    preemption_mode: PreemptionMode = field(
        default="recompute",
        metadata={"help": "what a preempted request loses: recompute (its blocks, re-prefilled later) "
                          "or swap (copied to host memory and back)"},
    )
    swap_space: float = field(
        default=4.0, metadata={"help": "GiB of host memory for swapped-out blocks (with preemption_mode swap)"}
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs", metadata={"help": "fcfs, or priority: the lower a request's priority value, the sooner"}
    )
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata={"help": "most prompt tokens one request prefills per step, so a huge prompt cannot stall "
                          "the others' decoding (None: no cap; needs chunked prefill)"},
    )
    max_logprobs: int = field(
        default=20,
        metadata={"help": "most logprobs / prompt_logprobs (top_logprobs in chat) a request may ask for, as vLLM"},
    )
    encoder_cache_bytes: int = field(
        default=256 * 2**20,
        metadata={"help": "bytes of vision-encoder outputs kept by image content hash, so a repeated image is "
                          "not encoded again (0: off; vision-language models only)"},
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    debug_invariants: bool = field(
        default=False, metadata={"help": "check every block-manager invariant after every step (slow)"}
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "never use CUDA graphs: decode steps run eagerly too (on CUDA they are otherwise "
                          "captured at start-up for batch sizes 1, 2, 4, ... up to max_num_seqs)"},
    )
    # Tensor parallelism runs over torch.distributed (gloo on CPU, NCCL on GPU).
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "ranks to split attention heads and MLP over"}
    )
    distributed_init_method: str | None = field(
        default=None,
        metadata={"help": "e.g. tcp://HOST:PORT: wait for `pagedllm worker` ranks started elsewhere "
                          "(None: spawn the other ranks on this machine)"},
    )
    distributed_timeout_s: float = field(
        default=60.0, metadata={"help": "seconds a collective may wait before it raises"}
    )
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch intra-op threads of each rank (None: torch's default with one rank, the "
                          "machine's cores // tensor_parallel_size with several; LLM(data_parallel_size=N): "
                          "cores // (N x tensor_parallel_size) per replica)"},
    )

    generation_config: GenerationConfigSource = field(
        default="auto",
        metadata={"help": "auto: the checkpoint's generation_config.json sets the default temperature, top_p, "
                          "top_k, min_p, repetition_penalty and max_tokens (max_new_tokens) of requests that leave "
                          "them unset; vllm: ignore the file"},
    )

    override_generation_config: dict | None = field(
        default=None,
        metadata={"help": "sampling defaults over generation_config.json's (with --generation-config vllm: "
                          "the only ones), in its key names, as vLLM's flag: '{\"max_new_tokens\": 512}' caps "
                          "the output of requests that set no max_tokens (JSON on the command line)"},
    )

    gguf_weights: GGUFWeights = field(
        default="packed",
        metadata={"help": "GGUF files: packed keeps Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights in their "
                          "blocks and multiplies them with a kernel that decodes tile by tile (memory ~ the file "
                          "size); dequantize decodes every weight to the model dtype at load"},
    )

    async_scheduling: bool = field(
        default=False,
        metadata={"help": "launch the next step's forward before building this step's outputs (detokenizing, "
                          "stop strings), so that work overlaps the model; a sequence a stop string ends "
                          "computes one token more, which is dropped"},
    )
    speculative_config: dict | None = field(
        default=None,
        metadata={"help": "speculative decoding, as vLLM spells it, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                          "(JSON on the command line; None: off)"},
    )

    kv_transfer_config: dict | None = field(
        default=None,
        metadata={"help": "vLLM's spelling of the host tier: '{\"kv_connector\": \"OffloadingConnector\", "
                          "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": N}}' "
                          "(instead of kv_offload_host_bytes)"},
    )
    kv_events_config: dict | None = field(
        default=None,
        metadata={"help": "publish KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": true, "
                          "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                          "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' (None: off)"},
    )

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ModelDType)
        SpeculativeConfig.from_option(self.speculative_config)  # validates
        KVEventsConfig.from_option(self.kv_events_config)  # validates
        offload = self.kv_offload  # validates
        if offload.enabled:
            self._check_offload_compatible()
        check_choice("gguf_weights", self.gguf_weights, GGUFWeights)
        check_choice("generation_config", self.generation_config, GenerationConfigSource)
        sampling_overrides(self.override_generation_config)  # validates
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None (auto), got {self.device!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        threads = self.num_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1 or None, got {threads!r}")
        if not isinstance(self.distributed_timeout_s, (int, float)) or self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got {self.distributed_timeout_s!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        budget = self.encoder_cache_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"encoder_cache_bytes must be an integer >= 0, got {budget!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat options, as ``LLM(...)`` and the command line take
        them: ``CacheConfig``'s fields beside this class's (no ``cache``)."""
        known = engine_option_fields()
        unknown = [name for name in options if name not in known]
        if unknown:
            raise ValueError(
                f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the options are: {', '.join(known)}"
            )
        nested = {}
        for name, config_class in NESTED_CONFIGS.items():
            names = {option.name for option in fields(config_class)}
            nested[name] = config_class(**{key: value for key, value in options.items() if key in names})
            options = {key: value for key, value in options.items() if key not in names}
        return cls(**nested, **options)

    def with_checkpoint_dtype(self, checkpoint_dtype: str | None) -> EngineConfig:
        """This config with ``dtype="auto"`` resolved to the checkpoint's dtype
        (float32 when it names none); other values are kept. Raises
        ``ValueError`` for a checkpoint dtype the engine does not run."""
        if self.dtype != "auto":
            return self
        resolved = checkpoint_dtype or "float32"
        if resolved not in _DTYPES:
            raise ValueError(f"dtype auto: the checkpoint's dtype {resolved!r} is not supported; "
                             f"pass --dtype with one of {', '.join(_DTYPES)}")
        return replace(self, dtype=resolved)

    def scheduler_config(self, model_max_len: int, layer_windows: Sequence[int | None] = ()) -> SchedulerConfig:
        """Resolve the defaults that depend on the loaded model. ``layer_windows``:
        each layer's sliding window (``model.shapes.sliding_windows_of``), from which
        the KV cache groups are made (``core.kv_groups``; one group without the
        hybrid manager)."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context window ({model_max_len})"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        kv_groups = kv_group_layout(layer_windows, hybrid=not self.cache.disable_hybrid_kv_cache_manager) \
            if layer_windows else None
        if kv_groups is not None and kv_groups.is_hybrid:
            refuse_what_hybrid_groups_cannot_run(self, kv_groups)
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            kv_groups=kv_groups,
            num_speculative_tokens=spec.num_speculative_tokens if (spec := self.speculative) else 0,
        )

    @property
    def kv_offload(self) -> KVOffloadConfig:
        """The offload tiers, from either spelling (``pagedllm.config.kv_offload``)."""
        cache = self.cache
        return KVOffloadConfig.from_options(cache.kv_offload_host_bytes, cache.kv_offload_dir,
                                            cache.kv_offload_disk_bytes, self.kv_transfer_config)

    def _check_offload_compatible(self) -> None:
        """The tiers keep prefix-cache blocks of one unsharded pool."""
        why = None
        if not self.cache.enable_prefix_caching:
            why = "they hold prefix-cache blocks: keep enable_prefix_caching on"
        elif self.cache.kv_layout != "paged":
            why = "they need kv_layout='paged'"
        elif self.tensor_parallel_size != 1:
            why = "tensor_parallel_size > 1 is not supported with them yet"
        elif (spec := self.speculative) is not None and spec.method == "draft_model":
            why = "a draft model's own KV pool is not offloaded yet: use method 'ngram' or no speculation"
        if why is not None:
            raise ValueError(f"KV offload tiers (kv_offload_host_bytes / kv_offload_dir / kv_transfer_config): {why}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` as a validated ``SpeculativeConfig`` (None: off)."""
        return SpeculativeConfig.from_option(self.speculative_config)


def sampling_overrides(override: dict | None) -> dict[str, Any]:
    """``override_generation_config`` as SamplingParams fields; ``ValueError``
    for a key it does not take or a value SamplingParams refuses."""
    from pagedllm.sampling_params import SamplingParams

    override = override or {}
    unknown = sorted(set(override) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {unknown}; it takes "
                         f"{sorted(GENERATION_CONFIG_FIELDS)}")
    fields_ = {GENERATION_CONFIG_FIELDS[key]: value for key, value in override.items()}
    SamplingParams(**fields_)  # raises ValueError naming a bad value
    return fields_


def threads_per_rank(num_threads: int | None, world_size: int, replicas: int = 1) -> int | None:
    """The torch intra-op threads of each rank of ``replicas`` engines of ``world_size``
    tensor-parallel ranks each: ``num_threads``, else the machine's cores shared among
    all those ranks; None (leave torch's default) for one rank of one engine without
    ``num_threads``."""
    if num_threads is not None:
        return num_threads
    ranks = world_size * replicas
    return max(1, (os.cpu_count() or 1) // ranks) if ranks > 1 else None


def engine_option_fields() -> dict[str, Field]:
    """Every engine option by name, in order: ``EngineConfig``'s fields with
    ``CacheConfig``'s in place of ``cache`` and ``LoRAConfig``'s in place of ``lora``
    (the flat names ``LLM(...)`` takes)."""
    options: dict[str, Field] = {}
    for option in fields(EngineConfig):
        nested = fields(NESTED_CONFIGS[option.name]) if option.name in NESTED_CONFIGS else (option,)
        options.update((inner.name, inner) for inner in nested)
    return options


# Option groups kept in their own dataclass, whose fields are flat engine options.
NESTED_CONFIGS = {"cache": CacheConfig, "lora": LoRAConfig, "pooling": PoolingConfig, "multimodal": MultiModalConfig}

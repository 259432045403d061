"""The registered differential cases: each name builds one or more
``DifferentialCase`` from the run's options. ``pagedllm bench differential``
runs them in full; ``tests/differential`` runs a slice of each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm import LLM
from pagedllm.bench.hf_reference import load_hf_model
from pagedllm_dev.differential.beam import beam_vs_hf
from pagedllm_dev.differential.generations import engine_greedy, hf_greedy
from pagedllm_dev.differential.harness import DifferentialCase


@dataclass(frozen=True)
class CaseOptions:
    """``model``: a local checkpoint (None: the default SmolLM2). ``max_tokens``:
    the free-running length. ``num_kv_blocks``: each engine's pool. ``engine``:
    further ``LLM(...)`` options every engine of every case is built with (the
    command's engine flags, ``gguf_weights="dequantize"`` for the fp32 path); what a
    case itself sets on one side wins."""

    model: str | None = None
    max_tokens: int = 64
    num_kv_blocks: int = 512
    engine: dict[str, Any] = field(default_factory=dict)

    def llm(self, **options: Any) -> LLM:
        """An engine of these options, ``options`` over them."""
        return LLM(**{**self.engine, "model": self.model, "num_kv_blocks": self.num_kv_blocks, **options})


def greedy_vs_hf(options: CaseOptions) -> list[DifferentialCase]:
    """Greedy generation, all prompts batched, against transformers' ``generate``
    one prompt at a time: the engine's own correctness claim."""
    llm = options.llm()
    hf_model = load_hf_model(options.model)
    tokenizer = llm.get_tokenizer()
    return [DifferentialCase(
        "greedy vs HF generate",
        oracle=lambda prompts: hf_greedy(hf_model, tokenizer, prompts, options.max_tokens),
        feature=lambda prompts: engine_greedy(llm, prompts, options.max_tokens),
        engines=(llm,),
    )]


def engine_option_vs_default(label: str, feature: dict, oracle: dict | None = None) -> "CaseFactory":
    """A case factory: greedy output of the engine built with ``feature``
    options against the same engine built with ``oracle`` options (default:
    none). Most options claim to change no token; a lossy one (quantized KV)
    is measured by how long the texts stay together."""

    def build(options: CaseOptions) -> list[DifferentialCase]:
        plain = options.llm(**(oracle or {}))
        changed = options.llm(**feature)
        return [DifferentialCase(
            label,
            oracle=lambda prompts: engine_greedy(plain, prompts, options.max_tokens),
            feature=lambda prompts: engine_greedy(changed, prompts, options.max_tokens),
            engines=(plain, changed),
        )]

    return build


CaseFactory = Callable[[CaseOptions], list[DifferentialCase]]

CASES: dict[str, CaseFactory] = {
    "greedy-hf": greedy_vs_hf,
    "speculative": engine_option_vs_default(
        "ngram speculation (k=4) vs none", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}),
    "async": engine_option_vs_default("async scheduling vs synchronous steps", {"async_scheduling": True}),
    # Long prompts split into 64-token chunks, interleaved with other requests' decodes.
    "chunked-prefill": engine_option_vs_default("64-token prefill chunks vs whole prompts",
                                                {"max_num_batched_tokens": 64}),
    # 40 blocks of 16 hold a few sequences at a time: the rest are preempted and recomputed.
    "preemption": engine_option_vs_default("preemption in a 40-block pool vs a roomy pool", {"num_kv_blocks": 40}),
    # A GPU-only claim: on a machine without CUDA the engine's own error says so.
    "cuda-graphs": engine_option_vs_default("CUDA graphs vs eager decode", {"device": "cuda"},
                                            {"device": "cuda", "enforce_eager": True}),
    # Not exact by design: the text parts at the first flipped token, so these report how soon.
    "kv-int8": engine_option_vs_default("int8 KV vs model-dtype KV", {"kv_cache_dtype": "int8"}),
    "kv-fp8": engine_option_vs_default("fp8_e4m3 KV vs model-dtype KV", {"kv_cache_dtype": "fp8_e4m3"}),
    "beam": beam_vs_hf,
}


def check_case_names(names: list[str]) -> None:
    """A ValueError naming every unregistered name (before any engine is built)."""
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise ValueError(f"unknown differential case(s) {unknown}: choose from {sorted(CASES)}")


def build_cases(names: list[str], options: CaseOptions) -> list[DifferentialCase]:
    """The cases of each registered name, in order; an unknown name is a ValueError."""
    check_case_names(names)
    return [case for name in names for case in CASES[name](options)]

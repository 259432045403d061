"""Mixtures of experts from GGUF files written with the ``gguf`` library as llama.cpp's converter
writes them (tests.model.moe_gguf): greedy output equals Hugging Face's free-running
``generate`` token for token on a batch of real-text prompts. Experts stored F32 load dense;
Q8_0 and MXFP4 expert stacks stay packed and run through the grouped kernel, and their oracle
is the Hugging Face model holding the dequantized experts. gpt-oss (llama.cpp's ``gpt-oss``
architecture: sinks, router and expert biases, YaRN) loads from F32 and from MXFP4 experts.
Routers are scaled so that the prompts reach every expert of every sparse layer; with
all-zero routers every token ties on the same experts. The start-up line counts packed experts at their dense size. The pool is
all-free after each engine run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedllm import LLM
from pagedllm.model.moe.packed_experts import PackedExperts
from pagedllm.model.moe.summary import parameter_counts
from tests.engine.test_hf_parity import TEXT
from tests.engine.test_moe_parity import _check, _experts_hit
from tests.model.moe_configs import moe_config, random_moe_model
from tests.model.moe_gguf import write_moe_gguf
from tests.model.test_loader import TINY_TOKENS


# llama.cpp hard-codes gpt-oss's SwiGLU limit at the released models' 7.0 (the file has no key);
# its routers (with their biases) need a larger scale for these prompts to reach every expert.
_GPT_OSS_OVERRIDES = dict(swiglu_limit=7.0)
_GPT_OSS_ROUTER_SCALE = 100.0


def _engine_and_oracle(folder: Path, family: str, expert_type: T, router_scale: float = 30.0):
    gpt_oss = family == "gpt_oss"
    config = moe_config(family, len(TINY_TOKENS), **(_GPT_OSS_OVERRIDES if gpt_oss else {}))
    model = random_moe_model(config, _GPT_OSS_ROUTER_SCALE if gpt_oss and router_scale else router_scale)
    path = write_moe_gguf(folder / f"{family}.gguf", model, expert_type)
    return LLM(str(path), num_kv_blocks=128, debug_invariants=True), model


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    """Byte-level tokens of real text, of mixed lengths."""
    ids = llm.get_tokenizer().encode(TEXT)
    return [ids[9 * i: 9 * i + 6 + (13 * i) % 29] for i in range(count)]


# Fast: one packed MXFP4 model (new decoder, packed stacks, grouped kernel); the rest are slow.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("family,expert_type", [
    ("qwen3_moe", T.MXFP4), pytest.param("qwen3_moe", T.F32, marks=_SLOW), pytest.param("qwen3_moe", T.Q8_0, marks=_SLOW),
    pytest.param("qwen2_moe", T.Q8_0, marks=_SLOW), pytest.param("olmoe", T.MXFP4, marks=_SLOW),
    pytest.param("mixtral", T.Q8_0, marks=_SLOW), pytest.param("granitemoe", T.MXFP4, marks=_SLOW),
    pytest.param("gpt_oss", T.MXFP4, marks=_SLOW), pytest.param("gpt_oss", T.F32, marks=_SLOW)],
    ids=lambda v: getattr(v, "name", v))
def test_gguf_moe_greedy_equals_hugging_face(tmp_path: Path, family: str, expert_type: T) -> None:
    llm, model = _engine_and_oracle(tmp_path, family, expert_type)
    batch = _prompts(llm, 6)
    assert all(len(experts) == 8 for experts in _experts_hit(model, batch)), "every expert gets tokens"
    engine_model = llm.llm_engine.model
    packed = [m for m in engine_model.modules() if isinstance(m, PackedExperts)]
    assert len(packed) == (0 if expert_type == T.F32 else 2 if family.startswith("qwen") else 3)
    total, active = parameter_counts(engine_model)
    assert total == sum(p.numel() for p in model.parameters()) and active < total
    _check(llm, model, batch, 8)


@pytest.mark.slow
def test_gguf_moe_all_tokens_on_the_same_experts(tmp_path: Path) -> None:
    llm, model = _engine_and_oracle(tmp_path, "qwen3_moe", T.Q8_0, router_scale=0.0)
    batch = _prompts(llm, 6)
    assert all(len(experts) == 2 for experts in _experts_hit(model, batch)), "all tokens on the same two experts"
    _check(llm, model, batch, 8)  # the pool all-free at the end

"""Greedy SmolLM2 in fp32 against Hugging Face, free-running on real text, through the
differential harness: the fp32 weights run on whatever this CPU multiplies them with
(the packed kernel on AVX-512, MKL and the small-batch kernel elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.packed_linear import PackedLinear, packing_supported
from pagedllm_dev.differential.cases import CaseOptions, build_cases
from pagedllm_dev.differential.compare import describe_divergence, format_reports
from pagedllm_dev.differential.harness import run_case
from pagedllm_dev.differential.prompts import real_text_prompts
from tests.conftest import assert_pool_free


@pytest.mark.slow
def test_smollm2_fp32_greedy_equals_hf_free_running(capsys):
    """16 real-text prompts, 40 greedy tokens each, all batched in the engine against HF
    one prompt at a time: every token the same (`python -m pagedllm_dev.differential --cases
    greedy-hf --gguf-weights dequantize` runs 50 x 64: 50 of 50 identical, BENCHMARKS.md
    "fp32 weights packed too")."""
    [case] = build_cases(["greedy-hf"], CaseOptions(max_tokens=40, engine={"gguf_weights": "dequantize"}))
    llm = case.engines[0]
    down_proj = llm.llm_engine.model.model.layers[0].mlp.down_proj
    assert isinstance(down_proj, PackedLinear) == packing_supported(torch.device("cpu"), torch.float32)
    report = run_case(case, real_text_prompts(16))
    with capsys.disabled():
        print("\n" + format_reports([report]))
    decode = llm.get_tokenizer().decode
    assert report.identical_fraction == 1.0, [describe_divergence(c, decode) for c in report.divergences()]
    assert report.logprob_error()[1] < 1e-3  # the worst chosen-token logprob error
    assert_pool_free(llm)

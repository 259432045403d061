"""The fused decode step (model/fused_decode.py): bit for bit the per-op path's logits and
tokens, and the per-op path wherever the stack cannot run. Each engine runs the same prompts
with the fused path and with ``PAGEDLLM_FUSED_DECODE=0`` (read per step), from an empty
prefix cache and over a warm one (prefix-cache hits). HF equality of the fused path itself: the tiny
Llama and SmolLM2 parity tests (tests/engine/test_hf_parity.py), whose decode steps of
<= 8 sequences are fused."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.fused_decode import SWITCH
from tests.conftest import assert_pool_free
from tests.model.test_quantized_engine import _tensor_type, _tiny_hf_model
from tests.model.test_loader import _write_gguf

# One stream, then three sharing a prefix (their decode steps: 1 and 3 rows).
PROMPTS = [[[5, 9, 2, 7, 3, 11, 4]], [[5, 9, 2, 7, 3, 11, 4, 8], [5, 9, 2, 7, 3, 6], [12, 3, 3, 9, 1]]]


def _runs(llm: LLM, monkeypatch) -> list:
    """Fused and per-op from an empty prefix cache, then per-op and fused over the cache they left
    (a prefill over cached blocks rounds unlike one over fresh K/V: compare like with like)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    results = []
    for switch, cold in (("1", True), ("0", True), ("0", False), ("1", False)):
        monkeypatch.setenv(SWITCH, switch)
        if cold:
            llm.reset_prefix_cache()
        run = []
        for prompts in PROMPTS:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            run.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                  for step in o.outputs[0].logprobs]) for o in outputs])
        results.append(run)
    assert_pool_free(llm)
    return results


def _assert_fused_equals_per_op(llm: LLM, monkeypatch) -> None:
    if load_cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels did not build: there is no fused path")
    fused, per_op, per_op_cached, fused_cached = _runs(llm, monkeypatch)
    assert llm.llm_engine.runner.model.fused_decode.active
    assert fused == per_op  # exact floats: the same kernels in the same order
    assert fused_cached == per_op_cached


@pytest.mark.parametrize("dtype,packing", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "0")])
def test_fused_decode_is_the_per_op_path_bit_for_bit(tiny_llama, monkeypatch, dtype, packing):
    """Weights packed for the packed kernel (fp32, bf16) and kept as nn.Linear (the small-batch kernel)."""
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", packing)
    _assert_fused_equals_per_op(LLM(tiny_llama, dtype=dtype, num_kv_blocks=64, block_size=4), monkeypatch)


def test_fused_decode_over_packed_gguf_blocks(tmp_path, monkeypatch):
    """GGUF blocks of several types (a q|k|v of two segments), with q/k/v and o biases."""
    path = str(_write_gguf(tmp_path / "q.gguf", "llama", _tiny_hf_model("llama"), tensor_type=_tensor_type))
    _assert_fused_equals_per_op(LLM(path, gguf_weights="packed", num_kv_blocks=64, block_size=4), monkeypatch)


def test_a_model_the_stack_cannot_run_keeps_the_per_op_path(tiny_model_dir):
    """Qwen3's q/k norms are not in the stack: its decode steps run op by op."""
    llm = LLM(tiny_model_dir("qwen3"), num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": PROMPTS[0][0]}], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    fused = llm.llm_engine.runner.model.fused_decode
    assert fused.checked and not fused.active
    assert_pool_free(llm)

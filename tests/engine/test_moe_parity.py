"""Tiny random mixtures of experts of every family: pagedllm's greedy output equals Hugging
Face's free-running ``generate`` (eager attention, eager experts) token for token.

Each model has three layers (Qwen3-MoE and Qwen2-MoE with one dense ``mlp_only_layers``
layer), 8 experts, top-2, expert width 32, routers scaled 30x so that routing is far from
uniform (the prompts' prefill sends tokens to every expert of every sparse layer, checked on
Hugging Face's routers). Fast: one batch of mixed-length prompts per family (gpt-oss's
window of 8 is shorter than most of them); slow, the same for gpt-oss and OLMoE in bf16 (18
tokens) against Hugging Face's bf16 load with its attention in fp32, rounded once, as the
engine's (gpt-oss's norms multiply their weights in fp32, before rounding). Slow: 16 prompts
with 40 new tokens, prefix caching on and a second round served from it; a model whose routers
are all zero (every token ties on the same two experts), gpt-oss left to the hybrid KV
oracle; a preemption run in a small pool.
Slow too: Qwen3-MoE and Qwen2-MoE (shared expert) on two tensor-parallel ranks, each rank
holding half of every expert's width, and gpt-oss (sinks and expert biases split) likewise;
and the engine with its experts on the Triton fused MoE kernel (through Triton's CPU
interpreter). The pool is all-free after each engine run. LoRA on a
mixture of experts is refused; the start-up line counts a packed GGUF's tied head once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from pagedllm import LLM
from pagedllm.attention.selector import prefill_kernel_for
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.kernels.triton_moe import fused_experts
from pagedllm.model.moe.experts import Experts
from pagedllm.model.moe.summary import weights_line
from tests.conftest import assert_pool_free
from tests.distributed.test_tensor_parallel import assert_no_workers_left
from tests.engine.test_hf_parity import TEXT
from tests.engine.arch_parity import hf_greedy
from tests.engine.test_sliding_window import greedy
from tests.model.moe_configs import FAMILIES, moe_config, random_moe_model


def _oracle(folder: Path, family: str, tokenizer, router_scale: float = 30.0) -> torch.nn.Module:
    model = random_moe_model(moe_config(family, len(tokenizer)), router_scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _prompts(tokenizer, count: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    return [ids[7 * i: 7 * i + 5 + (11 * i) % 37] for i in range(count)]


def _experts_hit(model: torch.nn.Module, batch: list[list[int]]) -> list[set[int]]:
    """The experts each sparse layer of the Hugging Face model routes the prompts' tokens to
    (read from its routers' outputs during one forward per prompt)."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hit: list[set[int]] = [set() for _ in routers]

    def record(index: int):
        return lambda module, args, out: hit[index].update(out[2].flatten().tolist())

    handles = [router.register_forward_hook(record(index)) for index, router in enumerate(routers)]
    with torch.no_grad():
        for prompt in batch:
            model(torch.tensor([prompt]))
    for handle in handles:
        handle.remove()
    return hit


def _generate_equals(llm: LLM, batch: list[list[int]], expected: list[list[int]]) -> None:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(len(expected[0])), use_tqdm=False)
    for prompt, tokens, output in zip(batch, expected, outputs):
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens"


def _check(llm: LLM, model: torch.nn.Module, batch: list[list[int]], new_tokens: int,
           cached_round: bool = False) -> None:
    """Greedy parity on ``batch`` (with ``cached_round``, run twice, the second time with the
    prompts' full blocks from the prefix cache), then the pool all-free."""
    expected = [hf_greedy(model, prompt, new_tokens) for prompt in batch]
    for _ in range(2 if cached_round else 1):
        _generate_equals(llm, batch, expected)
    if cached_round:
        assert llm.stats()["prefix_cache_hits"] > 0
    assert_pool_free(llm)


def _attention_in_fp32(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Hugging Face attention as pagedllm's C++ kernels compute it in bf16: scores, softmax and
    P . V in fp32, the output rounded once (eager rounds the scores and the probabilities to
    bf16, PyTorch's bf16 SDPA the probabilities)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1).float(), value.repeat_interleave(group, dim=1).float()
    scores = query.float() @ key.transpose(2, 3) * scaling
    queries, keys = scores.shape[-2:]
    if attention_mask is None:  # the causal (and sliding) mask Hugging Face leaves to the function
        attention_mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        if kwargs.get("sliding_window"):
            attention_mask &= ~attention_mask.tril(keys - queries - kwargs["sliding_window"])
    attention_mask = attention_mask[..., :keys]
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask.float()
    sinks = getattr(module, "sinks", None)  # gpt-oss's: a column that joins the softmax, then dropped
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)), dim=-1)
    out = torch.softmax(scores, dim=-1)[..., :keys] @ value
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("fp32_rounded_once", _attention_in_fp32)


def _cpp_bf16_attention() -> bool:
    """Whether a bf16 engine's prefill and decode attention run in the C++ kernels here (AVX-512
    BF16 without AMX; elsewhere PyTorch's SDPA, which rounds the probabilities to bf16)."""
    return (load_cpu_kernels() is not None and torch.cpu._is_avx512_bf16_supported()
            and prefill_kernel_for(torch.device("cpu"), torch.bfloat16) is not None)


# gpt-oss in bf16 runs 18 tokens: with Llama's norm rounding instead of its own, 2 of these 4
# prompts leave Hugging Face's greedy path within them (at tokens 16 and 17; a third at 31). In
# fp16, with its norm weights rounded to fp16, 11 of 16 prompts leave it within 40 tokens.
# The engine's bf16 attention is fp32, rounded once (the C++ kernels, gpt-oss's sink path), so
# the bf16 oracle computes attention that way: against eager attention, 6 of 16 OLMoE prompts
# leave its path within 40 tokens (the routers, the experts, the norms and the residual stream
# are otherwise bit for bit Hugging Face's).
@pytest.mark.parametrize("family,dtype", [*((family, "float32") for family in FAMILIES),
                                          pytest.param("olmoe", "bfloat16", marks=[pytest.mark.slow, pytest.mark.skipif(
                                              not _cpp_bf16_attention(), reason="bf16 attention not in C++ here")]),
                                          pytest.param("gpt_oss", "bfloat16", marks=pytest.mark.slow),
                                          pytest.param("gpt_oss", "float16", marks=pytest.mark.slow)])
def test_moe_greedy_equals_hugging_face(tmp_path: Path, smollm_tokenizer, family: str, dtype: str) -> None:
    model = _oracle(tmp_path, family, smollm_tokenizer)
    batch = _prompts(smollm_tokenizer, 4)
    assert all(len(experts) == 8 for experts in _experts_hit(model, batch)), "every expert gets tokens"
    if dtype != "float32":  # Hugging Face's own load of the checkpoint in that dtype
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype),
                                                     attn_implementation="fp32_rounded_once",
                                                     experts_implementation="eager")
    llm = LLM(str(tmp_path), dtype=dtype, num_kv_blocks=128, debug_invariants=True)
    if dtype == "float16":  # gpt-oss's norm weights stay fp32, as Hugging Face's do
        assert llm.llm_engine.model.model.norm.weight.dtype == model.model.norm.weight.dtype == torch.float32
    _check(llm, model, batch, 8 if dtype == "float32" else 18)


@pytest.mark.slow
# gpt-oss's prefix-cache rounds are the hybrid KV oracle's (tests/engine/test_hybrid_kv_oracle.py),
# whose prompts also cross its window; its Hugging Face generate is the slowest of the families.
@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "gpt_oss"])
def test_moe_batch_prefix_cache_and_ties(tmp_path: Path, smollm_tokenizer, family: str) -> None:
    model = _oracle(tmp_path / "scaled", family, smollm_tokenizer)
    batch = _prompts(smollm_tokenizer, 16)
    llm = LLM(str(tmp_path / "scaled"), num_kv_blocks=256, enable_prefix_caching=True, max_num_batched_tokens=64)
    _check(llm, model, batch, 40, cached_round=True)
    tied = _oracle(tmp_path / "tied", family, smollm_tokenizer, router_scale=0.0)
    assert all(len(experts) == 2 for experts in _experts_hit(tied, batch)), "all tokens on the same two experts"
    _check(LLM(str(tmp_path / "tied"), num_kv_blocks=256), tied, batch, 40)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_moe_preemption_in_a_small_pool(tmp_path: Path, smollm_tokenizer, mode: str) -> None:
    model = _oracle(tmp_path, "qwen2_moe", smollm_tokenizer)
    batch = _prompts(smollm_tokenizer, 8)
    llm = LLM(str(tmp_path), num_kv_blocks=14, preemption_mode=mode, swap_space=0.01, debug_invariants=True)
    _check(llm, model, batch, 40)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.slow
def test_moe_on_two_ranks_equals_hugging_face_and_one_rank(tmp_path: Path, smollm_tokenizer) -> None:
    """tensor_parallel_size=2 splits every expert's width (32 -> 16 per rank), Qwen2-MoE's shared
    expert's (40 -> 20) and the dense layer's; 12 prompts, 24 greedy tokens, one rank and two."""
    batch = _prompts(smollm_tokenizer, 12)
    for family in ("qwen3_moe", "qwen2_moe"):
        model = _oracle(tmp_path / family, family, smollm_tokenizer)
        expected = [hf_greedy(model, prompt, 24) for prompt in batch]
        single = LLM(str(tmp_path / family), num_kv_blocks=128)
        _generate_equals(single, batch, expected)
        assert_pool_free(single)
        tp = LLM(str(tmp_path / family), num_kv_blocks=128, tensor_parallel_size=2)
        try:
            _generate_equals(tp, batch, expected)
            assert_pool_free(tp)
        finally:
            assert_no_workers_left(tp)


@pytest.mark.slow
def test_gpt_oss_on_two_ranks_equals_hugging_face(tmp_path: Path, smollm_tokenizer) -> None:
    """gpt-oss on two ranks: each holds one KV head, its two query heads and their sinks, half of
    every expert's width with its gate|up biases; the down biases and o_proj's on rank 0 only."""
    model = _oracle(tmp_path, "gpt_oss", smollm_tokenizer)
    llm = LLM(str(tmp_path), num_kv_blocks=128, tensor_parallel_size=2)
    try:
        _check(llm, model, _prompts(smollm_tokenizer, 4), 8)
    finally:
        assert_no_workers_left(llm)


@pytest.mark.slow
def test_moe_on_the_triton_fused_kernel_equals_hugging_face(tmp_path: Path, smollm_tokenizer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2-MoE with every MoE block's experts on the fused kernel (which the engine takes on
    CUDA), run here through Triton's interpreter: prefill and decode, 4 prompts, 8 tokens."""
    model = _oracle(tmp_path, "qwen2_moe", smollm_tokenizer)
    monkeypatch.setattr(Experts, "forward", lambda self, x, indices, weights: fused_experts(
        x, self.gate_up_proj, self.down_proj, indices, weights, self.act_and_mul))
    _check(LLM(str(tmp_path), num_kv_blocks=128), model, _prompts(smollm_tokenizer, 4), 8)


def test_lora_on_a_mixture_of_experts_is_refused(tmp_path: Path, smollm_tokenizer) -> None:
    _oracle(tmp_path, "olmoe", smollm_tokenizer)
    with pytest.raises(ValueError, match=r"LoRA is not supported on mixture-of-experts.*mlp\.experts\.gate_up_proj"):
        LLM(str(tmp_path), num_kv_blocks=64, enable_lora=True)


def test_start_up_line_counts_a_packed_gguf_once() -> None:
    """SmolLM2-135M from its Q4_1 GGUF: the tied head and the embedding share their packed
    blocks, counted once (134.5M parameters, Hugging Face's count), all active."""
    llm = LLM(num_kv_blocks=32)
    assert weights_line(llm.llm_engine.model, 0) == "weights: 0.00 GiB, 134.5M of 134.5M parameters active per token"
    assert_pool_free(llm)

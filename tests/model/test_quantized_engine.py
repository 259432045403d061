"""GGUF weights kept packed, end to end: the engine's greedy output with packed
weights equals its output with the same file dequantized at load (the oracle,
itself checked against transformers in test_loader / test_hf_parity), and the
packed model holds about the file's size in memory."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.llama import LlamaForCausalLM as PagedLlama
from pagedllm.model.loader import default_model_path, load_checkpoint
from pagedllm.model.quantized import PackedEmbedding, PackedWeight, QuantizedLinear
from tests.conftest import assert_pool_free
from tests.engine.test_hf_parity import prompts_for
from tests.model.test_loader import TINY_TOKENS, _write_gguf

# Per projection, as in real files: q/k and v of different types (a fused qkv of two segments),
# gate/up of two, an embedding, an untied head.
TYPES = {"q_proj": T.Q5_0, "k_proj": T.Q5_0, "v_proj": T.Q8_0, "o_proj": T.Q4_1, "gate_proj": T.Q4_0,
         "up_proj": T.Q4_1, "down_proj": T.Q8_0, "embed_tokens": T.Q8_0, "lm_head": T.Q4_0}


def _tensor_type(name: str) -> T:
    module = name.rsplit(".", 2)[-2]
    return TYPES[module] if name.endswith(".weight") and module in TYPES else T.F32


def _tiny_hf_model(architecture: str):
    """Random weights large enough (initializer_range 0.2) that greedy picks are not float near-ties."""
    torch.manual_seed(0)
    shared = dict(vocab_size=len(TINY_TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    if architecture == "qwen3":  # tied embeddings: the head multiplies by the packed embedding
        return Qwen3ForCausalLM(Qwen3Config(**shared, head_dim=32, tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(**shared, attention_bias=True, tie_word_embeddings=False))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def quantized_gguf(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("quantized") / f"{request.param}.gguf"
    return str(_write_gguf(path, request.param, _tiny_hf_model(request.param), tensor_type=_tensor_type))


def _generate(path: str, gguf_weights: str, prompts: list[list[int]], dtype: str = "float32"):
    llm = LLM(path, gguf_weights=gguf_weights, dtype=dtype, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    return llm, outputs


def _assert_close_logprobs(packed, dequantized, max_nats: float) -> None:
    """Every prompt log-probability both runs report (the prompt token and the top 2) agrees."""
    for ours, oracle in zip(packed, dequantized):
        for mine, theirs in zip(ours.prompt_logprobs[1:], oracle.prompt_logprobs[1:]):
            assert mine.keys() & theirs.keys()
            for token_id in mine.keys() & theirs.keys():
                assert abs(mine[token_id].logprob - theirs[token_id].logprob) < max_nats


def _assert_same_greedy(packed, dequantized, max_nats: float) -> None:
    for ours, oracle in zip(packed, dequantized):
        assert ours.outputs[0].token_ids == oracle.outputs[0].token_ids
    _assert_close_logprobs(packed, dequantized, max_nats)


def test_packed_greedy_equals_dequantized(quantized_gguf):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(TINY_TOKENS), size=n).tolist() for n in (1, 5, 23, 60)]
    llm, packed = _generate(quantized_gguf, "packed", prompts)
    model = llm.llm_engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert [t.name for t in model.model.layers[0].self_attn.qkv_proj.qtypes] == ["Q5_0", "Q8_0"]
    assert isinstance(model.model.embed_tokens, PackedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    _, dequantized = _generate(quantized_gguf, "dequantize", prompts)
    _assert_same_greedy(packed, dequantized, 1e-4)


def _prompt_logprobs(outputs) -> torch.Tensor:
    """The log-probability of every prompt token after the first, all prompts concatenated."""
    return torch.tensor([entry[output.prompt_token_ids[i + 1]].logprob for output in outputs
                         for i, entry in enumerate(output.prompt_logprobs[1:])])


def test_packed_bfloat16_as_close_to_fp32_as_dequantized_bfloat16(quantized_gguf):
    """bf16 packed multiplies by the exact decoded weights (output rounded to bf16), bf16
    dequantized by their bf16 rounding: against the fp32 run, packed is off by no more than
    dequantized is (the bound test_hf_parity uses for bf16 against HF)."""
    prompts = [list(range(3, 40)), list(range(100, 110))]
    reference = _prompt_logprobs(_generate(quantized_gguf, "dequantize", prompts)[1])
    packed = (_prompt_logprobs(_generate(quantized_gguf, "packed", prompts, "bfloat16")[1]) - reference).abs()
    dense = (_prompt_logprobs(_generate(quantized_gguf, "dequantize", prompts, "bfloat16")[1]) - reference).abs()
    assert packed.max() < 0.35 and packed.mean() <= 1.5 * dense.mean(), (packed.mean(), dense.mean())


def test_tensor_parallel_falls_back_to_dense(quantized_gguf, caplog):
    """Shards are cut from dense weights: with 2 ranks the packed weights are dequantized first."""
    checkpoint = load_checkpoint(quantized_gguf, gguf_weights="packed")
    reference = load_checkpoint(quantized_gguf, gguf_weights="dequantize")
    tp = TensorParallelGroup(rank=1, world_size=2)
    sharded, oracle = PagedLlama(checkpoint.config, tp=tp), PagedLlama(reference.config, tp=tp)
    with caplog.at_level(logging.INFO):
        sharded.load_weights(checkpoint.state_dict)
    assert "dequantized" in caplog.text
    oracle.load_weights(reference.state_dict)
    assert not any(isinstance(m, (QuantizedLinear, PackedEmbedding)) for m in sharded.modules())
    expected = oracle.state_dict()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_packed_model_holds_about_the_file_size():
    checkpoint = load_checkpoint(None, gguf_weights="packed")
    model = PagedLlama(checkpoint.config, max_position=64)
    model.load_weights(checkpoint.state_dict)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied blocks count once
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    size = Path(default_model_path()).stat().st_size
    assert 0.9 * size < held < 1.1 * size, (held, size)
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)  # tied: the head multiplies by the embedding blocks


@pytest.mark.slow
def test_default_model_packed_greedy_equals_dequantized():
    """SmolLM2-135M Q4_1, real prompts: packed and dequantized pick the same tokens."""
    prompts = None
    results = {}
    for mode in ("packed", "dequantize"):
        llm = LLM(gguf_weights=mode, num_kv_blocks=256)
        prompts = prompts or prompts_for(llm.get_tokenizer())[:5]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
        results[mode] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_pool_free(llm)
    _assert_same_greedy(results["packed"], results["dequantize"], 1e-3)


def test_packed_weight_rows_follow_the_rope_unpermutation(quantized_gguf):
    """llama q/k rows are unpermuted as packed rows: decoding them equals the dequantized q/k."""
    packed = load_checkpoint(quantized_gguf, gguf_weights="packed").state_dict
    dense = load_checkpoint(quantized_gguf, gguf_weights="dequantize").state_dict
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert isinstance(packed[name], PackedWeight)
        assert torch.equal(packed[name].dequantize(), dense[name])


def test_packed_weights_of_the_wrong_shape_are_rejected(quantized_gguf):
    checkpoint = load_checkpoint(quantized_gguf, gguf_weights="packed")
    checkpoint.config.intermediate_size = 128  # the file's MLP is 96 wide
    with pytest.raises(ValueError, match=r"checkpoint does not match the model: .*gate_proj.weight is \[192, 64\]"):
        PagedLlama(checkpoint.config).load_weights(checkpoint.state_dict)

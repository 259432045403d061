"""GGUF rope scaling stored as tensors (Llama 3.1+'s rope_freqs, Phi-3's long/short factors),
Phi-3's layout, Granite's multipliers, SmolLM3's NoPE layers: loaded into the config, and
generating what Hugging Face generates."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import (
    GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, SmolLM3Config,
    SmolLM3ForCausalLM,
)

from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.rotary import rope_inv_freq
from tests.conftest import assert_pool_free
from tests.engine.arch_parity import hf_greedy, prompts
from tests.model.test_loader import TINY_TOKENS, _assert_same_tensors, _expected_parameters, _write_gguf

SHAPE = dict(vocab_size=len(TINY_TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama_cpp_rope_freqs(config: LlamaConfig) -> np.ndarray:
    """Llama 3.1's rope_freqs tensor, computed as llama.cpp's converter computes it."""
    rope = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old_context = rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def check_generation(path: str, hf_model, lengths: list[int]) -> None:
    batch = prompts(lengths, hf_model.config.vocab_size)
    llm = LLM(path, num_kv_blocks=64, debug_invariants=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert_pool_free(llm)
    with torch.inference_mode():
        for prompt, output in zip(batch, outputs):
            assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24), f"prompt of {len(prompt)} tokens"


def test_llama3_gguf_with_rope_freqs_generates_as_hf(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA3), initializer_range=0.2)).eval()
    rope_freqs = llama_cpp_rope_freqs(model.config)
    path = _write_gguf(tmp_path / "llama3.gguf", "llama", model,
                       extra=lambda writer: writer.add_tensor("rope_freqs.weight", rope_freqs))
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.config.gguf_rope_factors == rope_freqs.tolist()
    assert "rope_freqs.weight" not in checkpoint.state_dict
    # The frequencies agree with transformers' llama3 ones to fp32 rounding.
    torch.testing.assert_close(rope_inv_freq(checkpoint.config)[0], rope_inv_freq(model.config)[0],
                               rtol=1e-6, atol=0)
    check_generation(str(path), model, [3, 20, 40])


def phi3_model() -> Phi3ForCausalLM:
    """Phi-4-mini's shape in small: longrope, 3/4 of each head rotating, no sliding window."""
    half = 16 * 3 // 4 // 2
    config = Phi3Config(**SHAPE, original_max_position_embeddings=32, partial_rotary_factor=0.75,
                        sliding_window=None, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                                      "long_factor": [1.0 + 2.0 * i for i in range(half)]})
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


def write_phi3_gguf(path, model: Phi3ForCausalLM):
    """What llama.cpp's converter writes for a Phi-3 with longrope."""
    rope = model.config.rope_parameters

    def phi3_metadata(writer: GGUFWriter) -> None:
        writer.add_rope_dimension_count(12)
        writer.add_rope_scaling_orig_ctx_len(32)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(128 / 32) / math.log(32)))
        writer.add_sliding_window(0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    return _write_gguf(path, "phi3", model, extra=phi3_metadata)


def test_phi3_gguf_loads_as_the_hf_model(tmp_path):
    model = phi3_model()
    checkpoint = load_checkpoint(str(write_phi3_gguf(tmp_path / "phi3.gguf", model)))
    _assert_same_tensors(checkpoint.state_dict, _expected_parameters(model))
    config, expected = checkpoint.config, model.config
    assert config.model_type == "phi3" and config.sliding_window is None
    assert config.original_max_position_embeddings == 32
    for key in ("rope_type", "partial_rotary_factor", "long_factor", "short_factor"):
        assert config.rope_parameters[key] == pytest.approx(expected.rope_parameters[key]), key
    assert "attention_factor" not in config.rope_parameters  # derived as transformers derives it


def test_phi3_gguf_generates_as_hf(tmp_path):
    # Hugging Face's Phi-3 generate recomputes the whole cache with the long factors when a
    # sequence first crosses the window (docs/architecture.md "Model"): these prompts stay
    # inside it (3 + 24) or start beyond it.
    model = phi3_model()
    check_generation(str(write_phi3_gguf(tmp_path / "phi3.gguf", model)), model, [3, 40, 60])


def test_partial_rotary_is_refused_where_the_architecture_has_none(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    path = _write_gguf(tmp_path / "partial.gguf", "llama", model,
                       extra=lambda writer: writer.add_rope_dimension_count(8))
    with pytest.raises(ValueError, match=r"rope.dimension_count 8 differs from head_dim 16 .*'llama' does not"):
        load_checkpoint(str(path))


def test_granite_gguf_carries_the_multipliers(tmp_path):
    multipliers = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)
    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(**SHAPE, **multipliers, initializer_range=0.2)).eval()

    def scales(writer: GGUFWriter) -> None:  # as llama.cpp's GraniteModel converter names them
        writer.add_embedding_scale(3.0)
        writer.add_residual_scale(0.5)
        writer.add_attention_scale(0.1)
        writer.add_logit_scale(2.0)

    path = _write_gguf(tmp_path / "granite.gguf", "granite", model, extra=scales)
    checkpoint = load_checkpoint(str(path))
    _assert_same_tensors(checkpoint.state_dict, _expected_parameters(model))
    for key, value in multipliers.items():
        assert getattr(checkpoint.config, key) == pytest.approx(value), key
    check_generation(str(path), model, [3, 20])


def test_smollm3_gguf_keeps_every_fourth_layer_without_rope(tmp_path):
    torch.manual_seed(0)
    config = SmolLM3Config(**{**SHAPE, "num_hidden_layers": 4}, initializer_range=0.2, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    model = SmolLM3ForCausalLM(config).eval()
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    path = _write_gguf(tmp_path / "smollm3.gguf", "smollm3", model)
    checkpoint = load_checkpoint(str(path))
    _assert_same_tensors(checkpoint.state_dict, _expected_parameters(model))
    assert checkpoint.config.no_rope_layers == [1, 1, 1, 0]
    check_generation(str(path), model, [3, 20])

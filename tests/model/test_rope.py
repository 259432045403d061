"""RotaryEmbedding against Hugging Face's rotary embedding, token by token, for every rope type:
each token rotated as Hugging Face rotates it when it runs that token's sequence alone."""

from __future__ import annotations

import pytest
import torch
from transformers import Cohere2Config, LlamaConfig, Phi3Config
from transformers.models.cohere2 import modeling_cohere2
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.rotary import RotaryEmbedding, context_window_of, rope_inv_freq, token_lengths
from tests.engine.test_arch_parity_rope import ROPES, WINDOW, rope_config

HEADS, KV_HEADS = 4, 2
# Two decodes (positions 40 and 10), then prefill spans: positions 30..49 (a chunk whose context
# ends at 50) and 0..4 (a whole short prompt). Lengths straddle the 32-token window both ways.
DECODE_POSITIONS, DECODE_LENGTHS = [40, 10], [41, 11]
SPANS = [(30, 50), (0, 5)]  # (first position, context length after the step)


def step() -> tuple[torch.Tensor, AttentionMetadata]:
    positions = DECODE_POSITIONS + [p for start, end in SPANS for p in range(start, end)]
    spans, row = [], len(DECODE_POSITIONS)
    for start, end in SPANS:
        spans.append(PrefillSpan(row, end - start, end, torch.zeros(1, dtype=torch.long)))
        row += end - start
    metadata = AttentionMetadata(torch.zeros(len(positions), dtype=torch.long), len(DECODE_POSITIONS),
                                 torch.zeros(2, 1, dtype=torch.long), torch.tensor(DECODE_LENGTHS), spans)
    return torch.tensor(positions), metadata


def hf_rotated(config, hf_rope_class, q, k, position: int, length: int):
    """q/k ([heads, dim]) of one token at ``position`` as Hugging Face rotates it in a forward of
    a sequence of ``length`` tokens (a fresh rotary module: dynamic NTK keeps state)."""
    rope = hf_rope_class(config)
    cos, sin = rope(q, torch.arange(length)[None])
    q_out, k_out = apply_rotary_pos_emb(q[None, :, None], k[None, :, None], cos[:, position:position + 1],
                                        sin[:, position:position + 1])
    return q_out[0, :, 0], k_out[0, :, 0]


def check_against_hf(config, hf_rope_class) -> None:
    positions, metadata = step()
    head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    q = torch.randn(len(positions), HEADS, head_dim)
    k = torch.randn(len(positions), KV_HEADS, head_dim)
    rope = RotaryEmbedding(config, head_dim, max_position=4 * WINDOW)
    q_out, k_out = rope(positions, q.clone(), k.clone(), metadata)
    lengths = token_lengths(positions, metadata).tolist()
    for token, (position, length) in enumerate(zip(positions.tolist(), lengths)):
        q_ref, k_ref = hf_rotated(config, hf_rope_class, q[token], k[token], position, length)
        torch.testing.assert_close(q_out[token], q_ref, rtol=1e-5, atol=1e-5, msg=f"token {token} q")
        torch.testing.assert_close(k_out[token], k_ref, rtol=1e-5, atol=1e-5, msg=f"token {token} k")


@pytest.fixture(params=["cpp", "pytorch"])
def kernel_path(request, monkeypatch):
    """Both rotations: the fused C++ one and the PyTorch fallback."""
    if request.param == "pytorch":
        monkeypatch.setenv("PAGEDLLM_CPU_KERNEL", "0")
    elif load_cpu_kernels() is None:
        pytest.skip("the C++ kernels did not build on this machine")
    load_cpu_kernels.cache_clear()
    yield request.param
    load_cpu_kernels.cache_clear()


def test_token_lengths_follow_the_metadata():
    positions, metadata = step()
    assert token_lengths(positions, metadata).tolist() == DECODE_LENGTHS + [50] * 20 + [5] * 5
    assert token_lengths(torch.arange(7), None).tolist() == [7] * 7


@pytest.mark.parametrize("name", list(ROPES))
def test_every_rope_type_rotates_each_token_as_hf(name, kernel_path):
    check_against_hf(rope_config(name), LlamaRotaryEmbedding)


def test_partial_rotary_longrope_rotates_as_hf(kernel_path):
    """Phi-4-mini's shape: 3/4 of each head rotates, with longrope."""
    rot_half = 16 * 3 // 4 // 2
    config = Phi3Config(hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        max_position_embeddings=4 * WINDOW, original_max_position_embeddings=WINDOW,
                        partial_rotary_factor=0.75,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i for i in range(rot_half)],
                                      "long_factor": [2.0 + 3 * i for i in range(rot_half)]})
    check_against_hf(config, Phi3RotaryEmbedding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_rotates_as_cohere2(dtype, kernel_path):
    """Cohere 2's GPT-J rotation of adjacent channel pairs, bit for bit (bf16 too: fp32 arithmetic
    on cos/sin rounded to the dtype, rounded once at the end), whichever path NeoX rotation takes."""
    config = Cohere2Config(hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    positions = torch.tensor([0, 3, 17, 40])
    torch.manual_seed(0)
    q = torch.randn(len(positions), HEADS, 16, dtype=dtype)
    k = torch.randn(len(positions), KV_HEADS, 16, dtype=dtype)
    q_out, k_out = RotaryEmbedding(config, 16, max_position=64, interleaved=True)(positions, q.clone(), k.clone())
    cos, sin = modeling_cohere2.Cohere2RotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = modeling_cohere2.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1)) and torch.equal(k_out, k_ref[0].transpose(0, 1))


def test_gguf_rope_factors_divide_the_frequencies():
    config = rope_config("linear")
    plain, _ = rope_inv_freq(config)
    config.gguf_rope_factors = [1.0, 2.0, 4.0, 8.0, 1.0, 1.0, 1.0, 1.0]
    scaled, _ = rope_inv_freq(config)
    assert torch.equal(scaled, plain / torch.tensor(config.gguf_rope_factors))
    config.gguf_rope_factors = [1.0] * 3
    with pytest.raises(ValueError, match="rope_freqs has 3 entries; the rope has 8"):
        RotaryEmbedding(config, 16, max_position=8)


def test_unsupported_rope_type_is_named():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'proportional'; supported: default, linear, dynamic"):
        RotaryEmbedding(config, 16, max_position=8)


def test_dynamic_ntk_runs_past_its_window():
    """vLLM's rule: dynamic NTK's window is max_position_embeddings x factor; others keep theirs."""
    assert context_window_of(rope_config("dynamic")) == 4 * WINDOW
    assert context_window_of(rope_config("yarn")) == 4 * WINDOW
    assert context_window_of(LlamaConfig(max_position_embeddings=100)) == 100

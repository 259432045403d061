"""The Llama-like architectures beyond Llama/Qwen, greedy token for token against Hugging Face:
Phi-3 (fused checkpoint projections, longrope, partial rotary), SmolLM3 (layers without rope) and
Granite (embedding, residual, attention and logits multipliers)."""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteConfig, Phi3Config, Phi3ForCausalLM, SmolLM3Config

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.sharding import shard_layout
from pagedllm.model.checkpoint import Checkpoint
from pagedllm.model.registry import build_model
from tests.conftest import TINY_COMMON
from tests.engine.arch_parity import check_greedy_parity, write_checkpoint

WINDOW = 32


def phi3_config() -> Phi3Config:
    """Phi-4-mini in small: longrope over a 32-token original window, 3/4 of each head rotating."""
    half = 16 * 3 // 4 // 2
    return Phi3Config(**{**TINY_COMMON, "max_position_embeddings": 4 * WINDOW}, tie_word_embeddings=False,
                      original_max_position_embeddings=WINDOW, partial_rotary_factor=0.75, sliding_window=None,
                      rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                    "long_factor": [1.0 + 2.0 * i for i in range(half)]})


@pytest.mark.slow  # ~30 s: Hugging Face generates 60 tokens, pagedllm three rounds
def test_phi3_matches_hf(tmp_path, smollm_tokenizer):
    folder = write_checkpoint(tmp_path, phi3_config(), smollm_tokenizer)
    # Hugging Face's Phi-3 generate recomputes the whole cache with the long factors when a
    # sequence first crosses the window (docs/architecture.md "Model"); these prompts stay
    # inside it (17 + 15) or start beyond it.
    check_greedy_parity(folder, [5, 17, 40, 70], new_tokens=15, chunked_up_to=WINDOW)


@pytest.mark.slow  # ~25 s
def test_smollm3_matches_hf(tmp_path, smollm_tokenizer):
    config = SmolLM3Config(**TINY_COMMON, no_rope_layers=[1, 0], tie_word_embeddings=True)
    folder = write_checkpoint(tmp_path, config, smollm_tokenizer)
    check_greedy_parity(folder, [5, 30, 60], new_tokens=24)


@pytest.mark.slow  # ~25 s
def test_granite_matches_hf(tmp_path, smollm_tokenizer):
    config = GraniteConfig(**TINY_COMMON, tie_word_embeddings=True, embedding_multiplier=3.0,
                           residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)
    folder = write_checkpoint(tmp_path, config, smollm_tokenizer)
    check_greedy_parity(folder, [5, 30, 60], new_tokens=24)


def test_phi3_fused_projections_shard_for_tensor_parallelism(monkeypatch):
    """Phi-3 checkpoints fuse q|k|v and gate|up; rank 1 of 2 gets the same cut of each part as a
    checkpoint with separate projections would give it."""
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "0")  # compared in nn.Linear's [out, in] layout
    torch.manual_seed(0)
    config = phi3_config()
    weights = Phi3ForCausalLM(config).state_dict()
    whole = build_model(Checkpoint(config, dict(weights), None, ""), 64, torch.device("cpu"), torch.float32)
    tp = TensorParallelGroup(rank=1, world_size=2)
    rank1 = build_model(Checkpoint(config, dict(weights), None, ""), 64, torch.device("cpu"), torch.float32, tp)
    layout = shard_layout(config, tp)
    attention, rank1_attention = whole.model.layers[0].self_attn, rank1.model.layers[0].self_attn
    q, k, v = attention.qkv_proj.weight.split([attention.q_size, attention.kv_size, attention.kv_size])
    expected_qkv = torch.cat([q[layout.q_rows], k[layout.kv_rows], v[layout.kv_rows]])
    assert torch.equal(rank1_attention.qkv_proj.weight, expected_qkv)
    gate, up = whole.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(rank1.model.layers[0].mlp.gate_up_proj.weight,
                       torch.cat([gate[layout.mlp_rows], up[layout.mlp_rows]]))

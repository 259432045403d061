"""Gemma 1/2/3: tiny random checkpoints written as llama.cpp writes GGUF files load to the
model they were written from; Gemma's RMSNorm rounds as Hugging Face's does."""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig, PreTrainedModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from pagedllm import LLM, SamplingParams
from pagedllm.model.gemma import GemmaForCausalLM, GemmaRMSNorm
from pagedllm.model.loader import load_checkpoint
from tests.conftest import assert_pool_free
from tests.engine.arch_parity import random_eager_model
from tests.model.test_loader import TINY_TOKENS, _write_gguf, add_decoder_metadata

GEMMA_ARCHS = ["gemma", "gemma2", "gemma3"]  # llama.cpp's names; Hugging Face calls the last gemma3_text


def tiny_gemma_config(arch: str, vocab_size: int, query_pre_attn_scalar: int = 24):
    """A small Gemma whose every difference from Llama is exercised: windows of 8 tokens
    (crossed by every prompt), soft caps low enough to change tokens and logprobs (Gemma 2), a query
    scale that is not head_dim ** -0.5, and Gemma 3's 5 local : 1 global layer pattern."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  # larger than this and the tiny Gemmas' greedy text collapses to one repeated token
                  initializer_range=0.05)
    if arch == "gemma":
        return GemmaConfig(**common, num_hidden_layers=2)
    if arch == "gemma2":
        return Gemma2Config(**common, num_hidden_layers=4, sliding_window=8,
                            query_pre_attn_scalar=query_pre_attn_scalar,
                            attn_logit_softcapping=0.5, final_logit_softcapping=3.0)
    return Gemma3TextConfig(**common, num_hidden_layers=6, sliding_window=8,
                            query_pre_attn_scalar=query_pre_attn_scalar)


def tiny_gemma(config) -> PreTrainedModel:
    """The random model; its norm weights are random too (zeros would hide ``1 + w``)."""
    return random_eager_model(config, 0.0)


def assert_hf_greedy(hf_model: PreTrainedModel, prompt: list[int], completion, eos_masked: int | None = None,
                     atol: float = 1e-4) -> None:
    """``completion`` (a pagedllm CompletionOutput, generated greedily after ``prompt`` with
    logprobs=0) is Hugging Face's: each token is the argmax of HF's logits over the prompt and the
    tokens before it (one causal forward gives every step's), and its logprob is HF's (which is
    what catches a final soft cap: it never moves the argmax). ``eos_masked``: the EOS id that
    min_tokens kept from being chosen."""
    tokens = list(completion.token_ids)
    choices, logprobs = _hf_choices(hf_model, tuple(prompt + tokens), len(tokens), eos_masked)
    assert tokens == choices, f"prompt of {len(prompt)} tokens"
    ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
    assert torch.allclose(ours, logprobs, atol=atol), f"prompt of {len(prompt)} tokens: {(ours - logprobs).abs().max()}"


_HF_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hf_choices(hf_model: PreTrainedModel, ids: tuple[int, ...], generated: int,
                eos_masked: int | None) -> tuple[list[int], torch.Tensor]:
    """HF's argmax at each of the last ``generated`` positions of ``ids`` and the logprob of the
    token there. Memoized per model: cases that differ only in the engine (the hybrid KV manager on
    and off) generate the same tokens, and the long prompts' forward is the costly half of a case."""
    memo = _HF_CHOICES.setdefault(hf_model, {})
    key = (ids, generated, eos_masked)
    if key not in memo:
        tokens = list(ids[len(ids) - generated:])
        with torch.inference_mode():
            # only the positions that chose a token: a 262k vocabulary's logits over a long prompt are GBs
            logits = hf_model(torch.tensor([ids]), logits_to_keep=generated + 1).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(generated), tokens]
            if eos_masked is not None:
                logits[:, eos_masked] = float("-inf")
        memo[key] = (logits.argmax(-1).tolist(), logprobs)
    return memo[key]


# --- GGUF, written as llama.cpp's converter writes Gemma ------------------------------------------

_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def _gemma_gguf_name(hf_name: str, arch: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if not base.startswith("model.layers."):
        return f"{_TO_GGUF[base]}.{suffix}"
    _, _, layer, part = base.split(".", 3)
    if part == "post_attention_layernorm":  # Gemma 1's is the norm before the MLP
        return f"blk.{layer}.{'ffn_norm' if arch == 'gemma' else 'post_attention_norm'}.{suffix}"
    return f"blk.{layer}.{_LAYER_TO_GGUF[part]}.{suffix}"


def _llama_cpp_weights(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """HF name -> what llama.cpp stores: norm weights as 1 + w (in fp32), the rest as is;
    the tied LM head is not written."""
    return {name: (param.detach().numpy() + np.float32(1)) if name.endswith("norm.weight") else param.detach().numpy()
            for name, param in model.named_parameters()}


def write_gemma_gguf(path: Path, arch: str, model: PreTrainedModel) -> Path:
    config = model.config

    def gemma_metadata_and_tensors(writer: GGUFWriter) -> None:
        add_decoder_metadata(writer, config)
        if arch != "gemma":
            writer.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        # Gemma 3's is the global layers' base; llama.cpp fixes the local layers' at 10000
        rope = config.rope_parameters["full_attention"] if arch == "gemma3" else config.rope_parameters
        writer.add_rope_freq_base(rope["rope_theta"])
        for name, weights in _llama_cpp_weights(model).items():
            writer.add_tensor(_gemma_gguf_name(name, arch), weights)

    return _write_gguf(path, arch, None, extra=gemma_metadata_and_tensors)


@pytest.fixture(scope="module", params=GEMMA_ARCHS)
def gemma_gguf(request, tmp_path_factory) -> tuple[str, PreTrainedModel, Path]:
    arch = request.param
    # llama.cpp cannot store query_pre_attn_scalar: it scales by head_dim ** -0.5 (below 27B)
    model = tiny_gemma(tiny_gemma_config(arch, len(TINY_TOKENS), query_pre_attn_scalar=16))
    return arch, model, write_gemma_gguf(tmp_path_factory.mktemp(arch) / "tiny.gguf", arch, model)


def test_tiny_gemma_gguf_loads_the_weights_and_config_it_was_written_from(gemma_gguf):
    arch, model, path = gemma_gguf
    checkpoint = load_checkpoint(str(path))
    # norms come back as (1 + w) - 1 in fp32, as transformers' GGUF loader gives them
    expected = {name: torch.from_numpy(weights - np.float32(1)) if name.endswith("norm.weight")
                else torch.from_numpy(weights) for name, weights in _llama_cpp_weights(model).items()}
    assert set(checkpoint.state_dict) == set(expected)
    for name, tensor in checkpoint.state_dict.items():
        assert torch.equal(tensor, expected[name]), name
    config, reference = checkpoint.config, model.config
    assert config.model_type == reference.model_type
    fields = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "tie_word_embeddings", "rope_parameters"]
    if arch != "gemma":
        fields += ["sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                   "final_logit_softcapping"]
    for field in fields:
        assert getattr(config, field) == getattr(reference, field), field
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps)  # GGUF stores it as float32


def test_tiny_gemma_gguf_generates_what_its_model_does(gemma_gguf):
    arch, model, path = gemma_gguf
    prompts = [[(37 * i + 11 * j) % len(TINY_TOKENS) for j in range(length)] for i, length in enumerate([5, 19, 40])]
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=16, debug_invariants=True)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    for prompt, output in zip(prompts, outputs):
        assert_hf_greedy(model, prompt, output.outputs[0])


# --- pieces ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_is_hugging_faces_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(7, 64) * 3).to(dtype)
    ours, theirs = GemmaRMSNorm(64, 1e-6), Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(0.0, 0.5)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    assert torch.equal(ours(x), theirs(x))


def test_bidirectional_gemma3_is_refused():
    config = tiny_gemma_config("gemma3", 300)
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM(config)

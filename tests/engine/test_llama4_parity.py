"""A tiny random dense Llama 4 text model: pagedllm's greedy output equals Hugging Face's
free-running ``generate`` token for token.

Four layers as Llama 4 lays them out (three chunked local layers with rope, then a full NoPE
one), chunks of 32 tokens over blocks of 16, L2 q/k norm, temperature tuning with a
``floor_scale`` small enough to change the NoPE layer's queries within the prompts, llama3
rope scaling and random norm weights. Prompts of 150 to 190 tokens (five or more chunks) and
60 new tokens, chunked prefill, with the hybrid KV cache manager on and off; a later request
whose shared prefix outgrew a chunk still hits the prefix cache; both preemption modes in a
small pool (slow: a minute on two cores, most of it Hugging Face's generate). The fast test
runs the hybrid manager on a prompt of over two chunks and a prefix hit. The pool is
all-free after each test. int8 KV (slow) gives the hybrid manager the one-group int8 run's
tokens. A config with expert layers is refused.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Llama4TextConfig

from pagedllm import LLM, SamplingParams
from pagedllm.model.llama4 import Llama4ForCausalLM
from tests.conftest import assert_pool_free
from tests.engine.arch_parity import write_eager_model
from tests.engine.test_hf_parity import TEXT
from tests.engine.test_hybrid_kv_oracle import HYBRID
from tests.engine.test_int8_tails import assert_same, assert_tails_free, results
from tests.engine.test_sliding_window import greedy, hf_greedy

CHUNK = 32
BLOCK_SIZE = 16
NEW_TOKENS = 60
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _config(vocab_size: int, eos_token_id: int, **overrides) -> Llama4TextConfig:
    options = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, intermediate_size_mlp=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.2, moe_layers=[],
                   attention_chunk_size=CHUNK, floor_scale=16, attn_scale=0.5, rope_parameters=ROPE,
                   pad_token_id=None, eos_token_id=eos_token_id)
    return Llama4TextConfig(**{**options, **overrides})


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory, smollm_tokenizer) -> tuple[str, torch.nn.Module]:
    """A tiny random Llama 4 folder (with the SmolLM2 tokenizer) and its Hugging Face model."""
    config = _config(len(smollm_tokenizer), smollm_tokenizer.eos_token_id)
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    folder = tmp_path_factory.mktemp("tiny-llama4")
    return str(folder), write_eager_model(folder, config, smollm_tokenizer)


def _prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    return [ids[5 * i: 5 * i + n] for i, n in enumerate(lengths)]


def _check(llm: LLM, hf_model, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(new_tokens), use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, new_tokens), f"prompt of {len(prompt)}"
    return outputs


def _check_with_a_prefix_hit(llm: LLM, hf_model, lengths: list[int], shared: int, new_tokens: int) -> None:
    """Greedy parity on ``lengths``-token prompts, then on one that repeats the first ``shared``
    tokens of the last of them: that prefix, longer than a chunk, comes from the prefix cache."""
    batch = _prompts(llm.get_tokenizer(), lengths)
    _check(llm, hf_model, batch, new_tokens)
    (output,) = _check(llm, hf_model, [batch[-1][:shared] + batch[0][:21]], new_tokens)
    assert CHUNK < output.num_cached_tokens <= shared
    assert_pool_free(llm)


def _llm(folder: str, disable_hybrid: bool = False, **options) -> LLM:
    return LLM(folder, block_size=BLOCK_SIZE, max_num_batched_tokens=48, debug_invariants=True,
               disable_hybrid_kv_cache_manager=disable_hybrid, **options)


def test_tiny_llama4_matches_hf_past_two_chunks_with_the_hybrid_manager(tiny_llama4):
    folder, hf_model = tiny_llama4
    llm = _llm(folder, num_kv_blocks=64)
    assert [group["chunk"] for group in llm.kv_pool_snapshot()["kv_groups"]] == [None, CHUNK, CHUNK, CHUNK]
    _check_with_a_prefix_hit(llm, hf_model, [72], shared=64, new_tokens=12)


@pytest.mark.slow
@HYBRID
def test_tiny_llama4_matches_hf_over_many_chunks_and_hits_a_prefix_past_a_chunk(tiny_llama4, disable_hybrid):
    folder, hf_model = tiny_llama4
    llm = _llm(folder, disable_hybrid, num_kv_blocks=96)
    assert len(llm.kv_pool_snapshot()["kv_groups"]) == (1 if disable_hybrid else 4)
    _check_with_a_prefix_hit(llm, hf_model, [150, 170, 190], shared=128, new_tokens=NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_llama4_preempted_in_a_small_pool_matches_hf(tiny_llama4, mode):
    folder, hf_model = tiny_llama4
    llm = _llm(folder, num_kv_blocks=40, preemption_mode=mode, swap_space=0.01)
    _check(llm, hf_model, _prompts(llm.get_tokenizer(), [150, 160, 140, 170]))
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_free(llm)


@pytest.mark.slow
def test_int8_kv_with_the_hybrid_manager_matches_the_one_group_int8_run(tiny_llama4):
    """int8 KV and its full-precision tails under chunked masking: the hybrid manager's tokens
    and logprobs are the one-group run's (int8 is not Hugging Face-exact, so that is the oracle)."""
    folder, _ = tiny_llama4
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    runs = []
    for disable_hybrid in (False, True):
        llm = _llm(folder, disable_hybrid, num_kv_blocks=96, kv_cache_dtype="int8")
        batch = _prompts(llm.get_tokenizer(), [150, 170])
        runs.append(results(llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)))
        assert_tails_free(llm)
    assert_same(*runs)


def test_a_llama4_with_expert_layers_is_refused(smollm_tokenizer):
    config = _config(len(smollm_tokenizer), smollm_tokenizer.eos_token_id, moe_layers=[1, 3])
    with pytest.raises(ValueError, match=r"mixtures of experts are not supported yet \(issue 57\)"):
        Llama4ForCausalLM(config)


def test_layer_kinds_are_read_from_layer_types(smollm_tokenizer):
    """Chunked layers where ``layer_types`` says so (whatever ``no_rope_layers`` says), full
    ones elsewhere; without ``attention_chunk_size`` every layer is full attention."""
    from pagedllm.core.kv_managers.chunked_local import ChunkedLocal
    from pagedllm.model.shapes import layer_attention_of

    vocab, eos = len(smollm_tokenizer), smollm_tokenizer.eos_token_id
    assert layer_attention_of(_config(vocab, eos)) == [ChunkedLocal(CHUNK)] * 3 + [None]
    custom = _config(vocab, eos, layer_types=["full_attention", "chunked_attention"] * 2)
    assert layer_attention_of(custom) == [None, ChunkedLocal(CHUNK)] * 2
    assert layer_attention_of(_config(vocab, eos, attention_chunk_size=None)) == [None] * 4

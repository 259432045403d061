"""Tiny random BERT, XLM-RoBERTa and ModernBERT models against Hugging Face transformers.

The runner packs every input of one call into one batch (no padding); each input's
hidden states (``encode``) and classifier probabilities (``classify``) must match the
Hugging Face model run on that input alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.bert import packed_attention, padding_groups
from pagedllm.model.encoder_linear import linear, linear_add, linear_gelu
from pagedllm.pooling.encoder_runner import EncoderPoolingRunner, PoolingInput, is_encoder_checkpoint
from pagedllm.pooling_params import PoolingParams
from tests.pooling.conftest import real_texts, save_tiny

FAMILIES = ("bert", "xlm-roberta", "modernbert")


def _token_ids(runner: EncoderPoolingRunner, count: int) -> list[list[int]]:
    return runner.tokenizer(real_texts(count), truncation=True, max_length=runner.max_model_len)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_hugging_face(family, tmp_path, minilm_folder):
    model = save_tiny(tmp_path, minilm_folder, family)
    assert is_encoder_checkpoint(tmp_path)
    runner = EncoderPoolingRunner.from_folder(tmp_path, max_num_batched_tokens=512)
    assert runner.supported_tasks == ("embed", "encode")
    token_ids = _token_ids(runner, 12)
    assert max(map(len, token_ids)) > 40, "some inputs must cross ModernBERT's local window"
    outputs = runner.run([PoolingInput(ids, PoolingParams(task="encode")) for ids in token_ids])
    with torch.inference_mode():
        for ids, output in zip(token_ids, outputs):
            expected = model(torch.tensor([ids])).last_hidden_state[0]
            assert output.shape == expected.shape
            torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_labels", (3, 1))
def test_classifier_probabilities_match_hugging_face(family, num_labels, tmp_path, minilm_folder):
    extra = {"classifier_pooling": "mean"} if family == "modernbert" else {}
    model = save_tiny(tmp_path, minilm_folder, family, classifier=True, num_labels=num_labels, **extra)
    runner = EncoderPoolingRunner.from_folder(tmp_path)
    assert runner.supported_tasks == (("classify", "score", "encode") if num_labels == 1 else ("classify", "encode"))
    token_ids = _token_ids(runner, 6)
    probs = runner.run([PoolingInput(ids, PoolingParams(task="classify")) for ids in token_ids])
    logits = runner.run([PoolingInput(ids, PoolingParams(task="classify", use_activation=False)) for ids in token_ids])
    with torch.inference_mode():
        for ids, prob, logit in zip(token_ids, probs, logits):
            expected = model(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logit, expected, atol=1e-5, rtol=1e-4)
            activated = torch.sigmoid(expected) if num_labels == 1 else torch.softmax(expected, -1)
            torch.testing.assert_close(prob, activated, atol=1e-5, rtol=1e-4)


def test_segment_ids_reach_the_model(tmp_path, minilm_folder):
    """A text pair's token_type_ids change BERT's output, as they change Hugging Face's."""
    model = save_tiny(tmp_path, minilm_folder, "bert", classifier=True, num_labels=2)
    runner = EncoderPoolingRunner.from_folder(tmp_path)
    pair = runner.tokenizer("What is paging?", "Blocks of KV cache in a pool.")
    got = runner.run([PoolingInput(pair["input_ids"], PoolingParams(task="classify", use_activation=False),
                                   token_type_ids=pair["token_type_ids"])])[0]
    with torch.inference_mode():
        expected = model(torch.tensor([pair["input_ids"]]),
                         token_type_ids=torch.tensor([pair["token_type_ids"]])).logits[0]
        unsegmented = model(torch.tensor([pair["input_ids"]])).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, unsegmented, atol=1e-4)


def test_a_small_token_budget_gives_the_same_vectors(tmp_path, minilm_folder):
    save_tiny(tmp_path, minilm_folder, "bert")
    token_ids = _token_ids(EncoderPoolingRunner.from_folder(tmp_path), 16)
    inputs = [PoolingInput(ids, PoolingParams(task="embed")) for ids in token_ids]
    one_batch = EncoderPoolingRunner.from_folder(tmp_path, max_num_batched_tokens=8192).run(inputs)
    many = EncoderPoolingRunner.from_folder(tmp_path, max_num_batched_tokens=40).run(inputs)
    for a, b in zip(one_batch, many):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_padding_groups_bound_the_padding():
    assert padding_groups((100, 90, 80, 10, 9)) == [(100, 90, 80), (10, 9)]
    assert padding_groups((5,)) == [(5,)]


@pytest.mark.parametrize("window", (None, 4))
@pytest.mark.parametrize("head_dim, dtype", ((8, torch.float32), (48, torch.float32), (32, torch.bfloat16)))
def test_packed_attention_is_attention_per_sequence(window, head_dim, dtype):
    """Unsorted lengths (several padding groups, sequences across key tiles), with and without a
    local window, q/k/v as views of one fused QKV output. Head size 8 takes the padded SDPA path;
    48 and 32 the C++ kernel where it is built (48: a half-width last column block)."""
    torch.manual_seed(0)
    lens = (3, 40, 1, 37, 12, 90)
    qkv = torch.randn(sum(lens), 3, 4, head_dim).to(dtype)
    q, k, v = qkv.unbind(1)
    got = packed_attention(q, k, v, lens, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for length in lens:
        pos = torch.arange(length)
        mask = None if window is None else (pos[:, None] - pos[None, :]).abs() <= window
        q_i, k_i, v_i = (x[start:start + length].transpose(0, 1).float() for x in (q, k, v))
        expected = torch.nn.functional.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask)
        torch.testing.assert_close(got[start:start + length].float(), expected.transpose(0, 1).reshape(length, -1),
                                   atol=tolerance, rtol=tolerance)
        start += length


def test_onednn_linears_match_pytorch():
    """The encoder's fused oneDNN linears (GELU or residual add in the epilogue) equal the plain
    PyTorch ops they replace, which run when oneDNN is switched off."""
    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(37, 64, generator=generator), torch.randn(37, 48, generator=generator)
    weight, bias = torch.randn(48, 64, generator=generator), torch.randn(48, generator=generator)
    fused = [linear(x, weight, bias), linear_gelu(x, weight, bias), linear_add(x, residual, weight, bias)]
    with torch.backends.mkldnn.flags(enabled=False):
        plain = [linear(x, weight, bias), linear_gelu(x, weight, bias), linear_add(x, residual, weight, bias)]
    expected = [F.linear(x, weight, bias), F.gelu(F.linear(x, weight, bias)), F.linear(x, weight, bias) + residual]
    for got in (fused, plain):
        for tensor, want in zip(got, expected):
            torch.testing.assert_close(tensor, want, atol=1e-5, rtol=1e-5)

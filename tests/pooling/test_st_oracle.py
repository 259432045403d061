"""sentence-transformers is the oracle: the same folder, the same vectors and scores.

The real all-MiniLM-L6-v2 folder on many real texts in one batch; hand-written
sentence-transformers folders around a tiny BERT (CLS, last token, a prompt left out
of the mean, concatenated modes, a Dense layer, Normalize); a tiny cross-encoder.
"""

from __future__ import annotations

import json

import pytest
import sentence_transformers
import torch
from safetensors.torch import save_file

from pagedllm.pooling.encoder_runner import EncoderPoolingRunner, PoolingInput
from pagedllm.pooling_params import PoolingParams
from tests.pooling.conftest import real_texts, save_tiny, write_json


def _embed(runner: EncoderPoolingRunner, texts: list[str], prompt: str = "") -> torch.Tensor:
    token_ids = runner.tokenizer([prompt + text for text in texts], truncation=True,
                                 max_length=runner.max_model_len)["input_ids"]
    prompt_tokens = runner.prompt_token_count(prompt) if prompt else 0
    return torch.stack(runner.run([PoolingInput(ids, PoolingParams(task="embed"), num_prompt_tokens=prompt_tokens)
                                   for ids in token_ids]))


def _assert_same_vectors(got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    assert got.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.min().item() >= 0.99999, f"lowest cosine {cosine.min().item()}"
    assert (got - expected).abs().max().item() <= atol


def test_minilm_matches_sentence_transformers(minilm_folder):
    texts = real_texts(96)
    runner = EncoderPoolingRunner.from_folder(minilm_folder)
    lengths = [len(ids) for ids in runner.tokenizer(texts)["input_ids"]]
    assert min(lengths) <= 3 and max(lengths) >= 200, "the inputs must span short and long"
    model = sentence_transformers.SentenceTransformer(str(minilm_folder), device="cpu")
    assert runner.max_model_len == model.max_seq_length == 256
    # The oracle's own batching pads each batch to its longest text; batches of 16 (sorted by
    # length, as encode does) pad far less than one of 96, for the same vectors (1e-7 apart).
    expected = model.encode(texts, convert_to_tensor=True, batch_size=16)
    _assert_same_vectors(_embed(runner, texts), expected, atol=1e-5)


# Pooling configs: new and legacy keys, the prompt in or out, modes concatenated.
POOLINGS = {
    "cls-legacy": {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
    "lasttoken": {"embedding_dimension": 32, "pooling_mode": "lasttoken"},
    "mean-without-prompt": {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": False},
    "cls-without-prompt": {"embedding_dimension": 32, "pooling_mode": "cls", "include_prompt": False},
    "all-modes-without-prompt": {"embedding_dimension": 32, "include_prompt": False,
                                 "pooling_mode": ["mean", "max", "weightedmean", "mean_sqrt_len_tokens"]},
}


def _write_st_folder(folder, pooling: dict, width: int) -> None:
    """modules.json: Transformer, Pooling, Dense (width -> 16, Tanh), Normalize."""
    write_json(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(folder / "1_Pooling" / "config.json", pooling)
    write_json(folder / "2_Dense" / "config.json", {"in_features": width, "out_features": 16, "bias": True,
                                                    "activation_function": "torch.nn.modules.activation.Tanh"})
    generator = torch.Generator().manual_seed(1)
    save_file({"linear.weight": torch.randn(16, width, generator=generator) * 0.3,
               "linear.bias": torch.randn(16, generator=generator) * 0.1}, str(folder / "2_Dense" / "model.safetensors"))
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": 128, "do_lower_case": False})
    write_json(folder / "config_sentence_transformers.json",
               {"prompts": {"query": "Represent this sentence for searching relevant passages: ", "document": ""},
                "default_prompt_name": None})


@pytest.mark.parametrize("name", POOLINGS)
def test_a_hand_written_folder_matches_sentence_transformers(name, tmp_path, minilm_folder):
    save_tiny(tmp_path, minilm_folder, "bert")
    pooling = POOLINGS[name]
    modes = pooling.get("pooling_mode", "cls")
    _write_st_folder(tmp_path, pooling, width=32 * (len(modes) if isinstance(modes, list) else 1))
    runner = EncoderPoolingRunner.from_folder(tmp_path)
    model = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu")
    assert runner.max_model_len == 128
    assert runner.prompts == model.prompts and runner.default_prompt_name is None
    texts = real_texts(12)
    prompt = runner.prompts["query"]
    expected = model.encode(texts, prompt_name="query", convert_to_tensor=True, batch_size=len(texts))
    _assert_same_vectors(_embed(runner, texts, prompt), expected, atol=1e-5)


def test_dimensions_and_normalize_override_the_folder(tmp_path, minilm_folder):
    save_tiny(tmp_path, minilm_folder, "bert")
    _write_st_folder(tmp_path, POOLINGS["lasttoken"], width=32)
    runner = EncoderPoolingRunner.from_folder(tmp_path)
    ids = runner.tokenizer("Matryoshka embeddings keep their first numbers.")["input_ids"]
    full, raw, cut = runner.run([PoolingInput(ids, PoolingParams(task="embed")),
                                 PoolingInput(ids, PoolingParams(task="embed", normalize=False)),
                                 PoolingInput(ids, PoolingParams(task="embed", dimensions=8))])
    assert full.shape == (16,) and cut.shape == (8,)
    torch.testing.assert_close(full, torch.nn.functional.normalize(raw, dim=-1))
    torch.testing.assert_close(cut, torch.nn.functional.normalize(raw[:8], dim=-1))


@pytest.mark.parametrize("activation", [None, "torch.nn.modules.linear.Identity"])
def test_cross_encoder_scores_match_sentence_transformers(activation, tmp_path, minilm_folder):
    save_tiny(tmp_path, minilm_folder, "bert", classifier=True, num_labels=1)
    if activation is not None:  # what CrossEncoder.save writes when its activation is not the default
        config = json.loads((tmp_path / "config.json").read_text())
        write_json(tmp_path / "config.json", {**config, "sentence_transformers": {"activation_fn": activation}})
    runner = EncoderPoolingRunner.from_folder(tmp_path)
    query = "How does the engine share a prompt's KV cache between requests?"
    documents = real_texts(24)
    pairs = [[query, document] for document in documents]
    expected = sentence_transformers.CrossEncoder(str(tmp_path), device="cpu").predict(pairs, convert_to_tensor=True)
    encoded = runner.tokenizer([query] * len(documents), documents, truncation=True, max_length=runner.max_model_len)
    scores = runner.run([PoolingInput(ids, PoolingParams(task="score"), token_type_ids=types)
                         for ids, types in zip(encoded["input_ids"], encoded["token_type_ids"])])
    got = torch.cat(scores)
    assert all(score.shape == (1,) for score in scores)
    assert (got - expected.float()).abs().max().item() <= 1e-4
    assert torch.equal(torch.argsort(got, descending=True), torch.argsort(expected.float(), descending=True))

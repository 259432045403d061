"""Instruction prompts and per-input PoolingParams through ``LLM.embed``, against sentence-transformers.

The real all-MiniLM-L6-v2 folder, copied with instruction prompts, a default prompt and
``include_prompt: false`` added to its configs, against ``SentenceTransformer.encode`` with the
same prompt choice; a tiny random decoder given a sentence-transformers folder (last-token
pooling, no Normalize, prompts) against sentence-transformers too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import sentence_transformers
import torch

from pagedllm import LLM
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.pooling.encoder_server import EncoderEngineClient
from pagedllm.entrypoints.pooling_api import encoder_runner_for
from pagedllm.pooling_params import PoolingParams
from pagedllm.utils import free_port
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import uvicorn_thread
from tests.pooling.conftest import real_texts, write_json

QUERY = "Represent this sentence for searching relevant passages: "
QWEN3_STYLE = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
PROMPTS = {"prompts": {"query": QUERY, "document": ""}, "default_prompt_name": "query"}


def _linked_copy(source: Path, target: Path) -> Path:
    """``source``'s files linked into ``target`` (the configs this test rewrites are written over)."""
    for path in source.rglob("*"):
        if path.is_file():
            (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path, target / path.relative_to(source))
    return target


def _rewrite(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    path.unlink(missing_ok=True)  # a link to the original: write a file of its own
    write_json(path, {**data, **changes})


def _texts(count: int) -> list[str]:
    """Real texts of mixed lengths that fit the model with a prompt (sentence-transformers would cut a longer one)."""
    return [text for text in real_texts(3 * count) if len(text) < 600][:count]


def _assert_same(got: list, expected: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(torch.tensor([o.outputs.embedding for o in got]), expected.float())
    assert cosine.min().item() >= 0.99999, f"lowest cosine {cosine.min().item()}"


@pytest.fixture(scope="module")
def prompted_folder(minilm_folder, tmp_path_factory) -> Path:
    """The MiniLM folder with prompts, a default prompt and include_prompt: false."""
    folder = _linked_copy(Path(minilm_folder), tmp_path_factory.mktemp("minilm-prompts"))
    _rewrite(folder / "config_sentence_transformers.json", **PROMPTS)
    _rewrite(folder / "1_Pooling" / "config.json", include_prompt=False)
    return folder


@pytest.fixture(scope="module")
def prompted_minilm(prompted_folder) -> tuple[LLM, sentence_transformers.SentenceTransformer]:
    return (LLM(str(prompted_folder), runner="pooling"),
            sentence_transformers.SentenceTransformer(str(prompted_folder), device="cpu"))


def test_encoder_prompts_match_sentence_transformers(prompted_minilm):
    texts = _texts(10)
    llm, model = prompted_minilm
    # The default prompt, a named one (empty: no prompt), and an instruction given as text.
    _assert_same(llm.embed(texts, use_tqdm=False), model.encode(texts, convert_to_tensor=True))
    _assert_same(llm.embed(texts, prompt_name="document", use_tqdm=False),
                 model.encode(texts, prompt_name="document", convert_to_tensor=True))
    _assert_same(llm.embed(texts, instruction=QWEN3_STYLE, use_tqdm=False),
                 model.encode(texts, prompt=QWEN3_STYLE, convert_to_tensor=True))
    [default] = llm.embed(texts[:1], use_tqdm=False)
    assert default.prompt == QUERY + texts[0]
    with pytest.raises(ValueError, match=r"prompt_name 'passage' is not one of this model's prompts \('query', "):
        llm.embed(texts, prompt_name="passage")
    ids = llm.get_tokenizer()("token ids are taken as given")["input_ids"]
    [as_given] = llm.embed([ids], use_tqdm=False)  # the default prompt is for text inputs
    assert as_given.prompt_token_ids == ids
    with pytest.raises(ValueError, match="input 0 is token ids"):
        llm.embed([ids], prompt_name="query")


def test_per_input_pooling_params(prompted_minilm):
    llm = prompted_minilm[0]
    texts = _texts(3)
    full = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, PoolingParams(normalize=False),
                                                                 prompt_name="document", use_tqdm=False)]
    mixed = llm.embed(texts, [PoolingParams(dimensions=8), PoolingParams(normalize=False),
                              PoolingParams(truncate_prompt_tokens=3)], prompt_name="document", use_tqdm=False)
    normalize = torch.nn.functional.normalize
    assert torch.allclose(torch.tensor(mixed[0].outputs.embedding), normalize(full[0][:8], dim=0), atol=1e-6)
    assert torch.allclose(torch.tensor(mixed[1].outputs.embedding), full[1], atol=1e-6)
    assert len(mixed[2].prompt_token_ids) == 3 and len(mixed[2].outputs.embedding) == 384
    with pytest.raises(ValueError, match="pooling_params has 2 entries for 3 inputs"):
        llm.embed(texts, [PoolingParams(), PoolingParams()])


def test_decoder_folder_prompts_match_sentence_transformers(tiny_model_dir, tmp_path):
    folder = _linked_copy(Path(tiny_model_dir("qwen2")), tmp_path)
    write_json(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    write_json(folder / "1_Pooling" / "config.json", {"embedding_dimension": 64, "pooling_mode": "lasttoken",
                                                      "include_prompt": False})
    write_json(folder / "config_sentence_transformers.json",
               {"prompts": {"query": QWEN3_STYLE, "document": ""}, "default_prompt_name": None})
    texts = _texts(6)
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    expected = torch.stack([model.encode(text, prompt_name="query", convert_to_tensor=True) for text in texts])
    llm = LLM(str(folder), runner="pooling", dtype="float32", num_kv_blocks=32, block_size=16)
    got = llm.embed(texts, prompt_name="query", use_tqdm=False)
    _assert_same(got, expected)
    # No Normalize module: not normalized, as sentence-transformers leaves it.
    assert torch.allclose(torch.tensor(got[0].outputs.embedding), expected[0], atol=1e-4)
    assert_pool_free(llm)
    llm.shutdown()
    write_json(folder / "1_Pooling" / "config.json", {"embedding_dimension": 64, "pooling_mode": "mean"})
    with pytest.raises(ValueError, match="mean pooling; a decoder embedder is pooled at its last token"):
        LLM(str(folder), runner="pooling", dtype="float32", num_kv_blocks=32, block_size=16)


def test_embeddings_route_takes_prompt_name(prompted_folder, prompted_minilm):
    llm = prompted_minilm[0]
    runner = encoder_runner_for(str(prompted_folder), {"runner": "pooling"})
    state = ServerState(async_engine=EncoderEngineClient(runner), served_model_name="m", model_root=str(prompted_folder))
    port = free_port()
    texts = _texts(3)
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        for name in (None, "document"):  # the default prompt, a named one
            answer = httpx.post(url, json={"input": texts, "prompt_name": name}, timeout=60).json()
            want = llm.embed(texts, prompt_name=name, use_tqdm=False)
            for got, expected in zip(answer["data"], want):
                assert got["embedding"] == pytest.approx(expected.outputs.embedding, abs=1e-5)
            assert answer["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)
        refused = httpx.post(url, json={"input": texts, "prompt_name": "passage"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_name"
    assert "'query', 'document'" in refused.json()["error"]["message"]

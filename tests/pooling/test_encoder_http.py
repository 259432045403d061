"""The real all-MiniLM-L6-v2 served: ``pagedllm serve``'s encoder server (no engine, one
batching service) answers the ``openai`` client's ``embeddings.create`` with
``LLM.embed``'s vectors (float, base64, ``dimensions``), also to concurrent clients;
a cross-encoder's /v2/rerank and /classify are ``LLM.score``'s and ``LLM.classify``'s.
Real texts of 2 to ~480 tokens: the longer ones cut to the model's 256 by
``truncate_prompt_tokens=-1`` on both sides."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedllm import LLM
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.pooling.encoder_server import EncoderEngineClient
from pagedllm.entrypoints.pooling_api import encoder_runner_for
from pagedllm.pooling_params import PoolingParams
from pagedllm.utils import free_port
from tests.entrypoints.live_server import uvicorn_thread
from tests.pooling.conftest import real_texts, save_tiny

CUT = {"truncate_prompt_tokens": -1}  # the last 256 tokens of a longer text


@pytest.fixture(scope="module")
def served_minilm(minilm_folder):
    folder = str(minilm_folder)
    runner = encoder_runner_for(folder, {"runner": "pooling"})
    state = ServerState(async_engine=EncoderEngineClient(runner), served_model_name="minilm", model_root=folder)
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120), \
            LLM(folder, runner="pooling")


def test_openai_embeddings_are_llm_embed(served_minilm):
    client, llm = served_minilm
    texts = real_texts(40)
    want = [o.outputs.embedding for o in llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)]
    for answer in (client.embeddings.create(model="minilm", input=texts, extra_body=CUT),  # base64, decoded
                   client.embeddings.create(model="minilm", input=texts, encoding_format="float", extra_body=CUT)):
        for got, expected in zip(answer.data, want):
            assert got.embedding == pytest.approx(expected, abs=1e-5)
    cut = client.embeddings.create(model="minilm", input=texts[:3], dimensions=128, encoding_format="float")
    want_cut = llm.embed(texts[:3], PoolingParams(dimensions=128), use_tqdm=False)
    for got, expected in zip(cut.data, want_cut):
        assert len(got.embedding) == 128 and got.embedding == pytest.approx(expected.outputs.embedding, abs=1e-5)


def test_concurrent_clients_get_their_own_vectors(served_minilm):
    client, llm = served_minilm
    texts = real_texts(48)
    batches = [texts[i:i + 6] for i in range(0, len(texts), 6)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: client.embeddings.create(model="minilm", input=b, encoding_format="float",
                                                                   extra_body=CUT),
                                batches))
    want = [o.outputs.embedding for o in llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)]
    got = [d.embedding for answer in answers for d in answer.data]
    for vector, expected in zip(got, want):
        assert vector == pytest.approx(expected, abs=1e-5)


def test_a_cross_encoder_reranks_and_classifies_as_llm(minilm_folder, tmp_path):
    """A tiny BERT cross-encoder (one label, named in id2label): /rerank's order and scores are
    LLM.score's, /classify's probabilities and label LLM.classify's."""
    save_tiny(tmp_path, minilm_folder, "bert", classifier=True, num_labels=1, id2label={0: "relevant"})
    folder = str(tmp_path)
    llm = LLM(folder, runner="pooling")
    state = ServerState(async_engine=EncoderEngineClient(encoder_runner_for(folder, {"runner": "pooling"})),
                        served_model_name="ce", model_root=folder)
    query, documents = "what is paging", ["blocks of memory", "a ripe fruit", "paged attention shares blocks"]
    want = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        base = f"http://127.0.0.1:{port}"
        ranked = httpx.post(f"{base}/v2/rerank", json={"query": query, "documents": documents}, timeout=60).json()
        classified = httpx.post(f"{base}/classify", json={"input": documents}, timeout=60).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert sorted((r["index"], r["relevance_score"]) for r in ranked["results"]) == [
        (i, pytest.approx(score, abs=1e-5)) for i, score in enumerate(want)]
    for got, expected in zip(classified["data"], llm.classify(documents, use_tqdm=False)):
        assert got["probs"] == pytest.approx(expected.outputs.probs, abs=1e-5) and got["label"] == "relevant"

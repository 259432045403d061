"""The pooling routes of a ``--runner pooling`` server, live on a socket, against
the offline API on the same checkpoint: the ``openai`` client's embeddings
(float, base64, dimensions) are ``LLM.embed``'s vectors, /score and /rerank
``LLM.score``'s scores and order, /classify ``LLM.classify``'s probabilities;
the errors say what to change; the key is checked; the document lists the paths.
Tiny random decoders (one server per checkpoint per module); every engine's pool
is all free at the end."""

from __future__ import annotations

import base64
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pagedllm import LLM
from pagedllm.bench.soak import metric_value
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.pooling_params import PoolingParams
from pagedllm.utils import free_port
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import assert_server_pool_free, uvicorn_thread
from tests.pooling.test_decoder_pooling import ENGINE, _classifier_dir

KEY = "sk-pooling-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny-pooler"
TEXTS = ["hello", "A short sentence about retrieval.", "word " * 40, "x"]


def _serving(folder: str, **options):
    """(base URL, offline LLM) of a live pooling server on ``folder`` and an offline LLM on the same."""
    offline = LLM(folder, **ENGINE, **options)
    served = LLM(folder, **ENGINE, **options)
    state = ServerState(async_engine=AsyncLLMEngine(served.llm_engine), served_model_name=MODEL,
                        api_keys={KEY: None}, model_root=folder)
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        base = f"http://127.0.0.1:{port}"
        yield base, offline
        assert_server_pool_free(base, AUTH)
    assert_pool_free(served)
    assert_pool_free(offline)
    offline.shutdown()


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    yield from _serving(tiny_model_dir("qwen2"), runner="pooling")


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, smollm_tokenizer):
    folder = _classifier_dir(tmp_path_factory, smollm_tokenizer, "llama", 1)
    config = Path(folder) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "id2label": {"0": "relevant"}}))
    yield from _serving(folder, runner="auto")


@pytest.fixture(scope="module")
def reranker(tiny_model_dir):
    yield from _serving(tiny_model_dir("qwen3"), runner="pooling", convert="classify",
                        hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                      "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True})


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_embeddings_are_llm_embed(embedder):
    base, llm = embedder
    expected = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    client = _client(base)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    for answer in (floats, decoded):
        assert [d.index for d in answer.data] == list(range(len(TEXTS)))
        for got, want in zip(answer.data, expected):
            assert got.embedding == pytest.approx(want, abs=1e-5)
    packed = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    unpacked = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in packed.data]
    assert unpacked == [d.embedding for d in decoded.data]
    tokens = sum(len(o.prompt_token_ids) for o in llm.embed(TEXTS, use_tqdm=False))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    assert floats.model == MODEL
    cut = client.embeddings.create(model=MODEL, input="hello", dimensions=8, encoding_format="float")
    [want] = llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    assert cut.data[0].embedding == pytest.approx(want.outputs.embedding, abs=1e-5) and len(want.outputs.embedding) == 8
    ids = llm.get_tokenizer()("some words")["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:2]], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(llm.embed([ids], use_tqdm=False)[0].outputs.embedding, abs=1e-5)


def test_concurrent_clients_get_their_own_vectors(embedder):
    base, llm = embedder
    texts = [f"passage number {i} " * (1 + i % 5) for i in range(24)]
    expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    client = _client(base)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t, encoding_format="float"),
                                texts))
    for answer, want in zip(answers, expected):
        assert answer.data[0].embedding == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, None, "empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "word " * 600}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"input": "a", "priority": 3}, "priority", "not implemented"),
    ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
])
def test_embedding_errors_say_what_to_change(embedder, body, param, words):
    base, _ = embedder
    answer = httpx.post(f"{base}/v1/embeddings", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert words in error["message"] and error["param"] == param


def test_a_long_input_truncated_is_the_offline_truncation(embedder):
    base, llm = embedder
    answer = httpx.post(f"{base}/v1/embeddings", json={"input": "word " * 600, "truncate_prompt_tokens": 20},
                        headers=AUTH, timeout=60).json()
    [want] = llm.embed("word " * 600, truncate_prompt_tokens=20, use_tqdm=False)
    assert answer["data"][0]["embedding"] == pytest.approx(want.outputs.embedding, abs=1e-5)
    assert answer["usage"]["prompt_tokens"] == 20


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_generation_on_a_pooling_server_says_to_drop_the_runner(embedder, path):
    base, _ = embedder
    answer = httpx.post(f"{base}{path}", json={"prompt": "hi"}, headers=AUTH, timeout=60)
    assert answer.status_code == 400
    assert "start the server without --runner pooling" in answer.text


def test_auth_and_the_document(embedder):
    base, _ = embedder
    assert httpx.post(f"{base}/v1/embeddings", json={"input": "a"}, timeout=60).status_code == 401
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "a"}, timeout=60).status_code == 401
    paths = httpx.get(f"{base}/openapi.json", headers=AUTH, timeout=60).json()["paths"]
    for path in ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                 "/pooling"):
        assert "post" in paths[path], path
    assert "/v1/completions" not in paths and "/v1/chat/completions" not in paths  # answered with the 400 alone
    assert httpx.post(f"{base}/v1/embeddings", json={"input": "a"}, headers=AUTH, timeout=60).status_code == 200
    assert metric_value(httpx.get(f"{base}/metrics", timeout=60).text, "pagedllm:prompt_tokens_total") > 0


def test_score_and_rerank_are_llm_score(scorer):
    base, llm = scorer
    query, documents = "what is paging", ["blocks of memory", "a fruit", "paged attention shares blocks"]
    want = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    scored = httpx.post(f"{base}/score", json={"text_1": query, "text_2": documents}, headers=AUTH, timeout=60).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-5)
    assert scored["object"] == "list" and scored["usage"]["prompt_tokens"] > 0
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = httpx.post(f"{base}{path}", json={"query": query, "documents": documents, "top_n": 2},
                            headers=AUTH, timeout=60).json()
        assert [r["index"] for r in ranked["results"]] == order[:2], path
        assert ranked["results"][0]["relevance_score"] == pytest.approx(want[order[0]], abs=1e-5)
        assert ranked["results"][0]["document"] == {"text": documents[order[0]]}


def test_a_decoder_reranker_computes_the_query_once(reranker):
    base, llm = reranker
    query = "What does a paged KV cache share between the requests of one rerank?"
    documents = [f"Document {i}: " + "blocks " * (i % 7) for i in range(100)]
    outputs = llm.score(query, documents, use_tqdm=False)
    want = [o.outputs.score for o in outputs]
    ranked = httpx.post(f"{base}/v1/rerank", json={"query": query, "documents": documents}, headers=AUTH,
                        timeout=60).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(100), key=lambda i: -want[i])
    assert [r["relevance_score"] for r in sorted(ranked["results"], key=lambda r: r["index"])] == pytest.approx(
        want, abs=1e-5)
    # The template's and the query's full blocks are computed for the first document only: every later one
    # finds them cached (the documents differ from their first token on).
    shared = len(os.path.commonprefix([o.prompt_token_ids for o in outputs]))
    full_blocks = shared // ENGINE["block_size"] * ENGINE["block_size"]
    usage = ranked["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 99 * full_blocks, (usage, shared)
    assert usage["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outputs)


def test_classify_is_llm_classify_with_the_config_labels(scorer):
    base, llm = scorer
    want = llm.classify(TEXTS, use_tqdm=False)
    answer = httpx.post(f"{base}/classify", json={"input": TEXTS}, headers=AUTH, timeout=60).json()
    for got, expected in zip(answer["data"], want):
        assert got["probs"] == pytest.approx(expected.outputs.probs, abs=1e-5)
        assert got["label"] == "relevant" and got["num_classes"] == 1
    pooled = httpx.post(f"{base}/pooling", json={"input": "hello", "task": "classify"}, headers=AUTH,
                        timeout=60).json()
    assert pooled["data"][0]["data"] == pytest.approx(llm.classify("hello", use_tqdm=False)[0].outputs.probs,
                                                      abs=1e-5)
    refused = httpx.post(f"{base}/v1/embeddings", json={"input": "a"}, headers=AUTH, timeout=60)
    assert refused.status_code == 400 and "does not support the 'embed' task" in refused.text


def _loaded(client) -> None:
    deadline = time.monotonic() + 60
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.05)


def test_pooling_on_a_generation_server_says_to_start_it_pooling(serve):
    from fastapi.testclient import TestClient

    app, _, _ = serve()
    with TestClient(app) as client:
        _loaded(client)
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/rerank", {"query": "a", "documents": ["b"]})):
            answer = client.post(path, json=body)
            assert answer.status_code == 400
            assert "start the server with --runner pooling" in answer.json()["error"]["message"]
        paths = client.get("/openapi.json").json()["paths"]
        assert "/v1/completions" in paths and "/v1/embeddings" not in paths and "/rerank" not in paths


def test_pagedllm_serve_runner_pooling_embeds(serve):
    from fastapi.testclient import TestClient

    app, _, _ = serve("--runner", "pooling")
    with TestClient(app) as client:
        _loaded(client)
        answer = client.post("/v1/embeddings", json={"input": ["a", "b c"]}).json()
        assert [len(d["embedding"]) for d in answer["data"]] == [64, 64]


@pytest.mark.slow
def test_bench_served_row_through_the_engine_core_process(embedder, tiny_model_dir):
    """`pagedllm bench embed`'s served row: a `pagedllm serve --runner pooling` child (its engine in a
    core process) embeds as LLM.embed does, under concurrent clients."""
    from pagedllm.bench.embed import min_cosine, run_served

    _, llm = embedder
    texts = [f"passage {i} " * (1 + i % 9) for i in range(70)]
    served = run_served(tiny_model_dir("qwen2"), texts, clients=3,
                        server_args=["--dtype", "float32", "--num-kv-blocks", "64"], texts_per_request=8)
    assert min_cosine(served.vectors, [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]) > 0.99999

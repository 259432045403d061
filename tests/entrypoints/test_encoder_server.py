"""An encoder checkpoint's server: no engine, one batching service. A stand-in
runner (the contract's surface of ``pagedllm.pooling.encoder_runner``) records
each ``run`` call, so the test sees concurrent clients share batches, each get
its own vectors, and what the admin routes say of a server without a pool."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pagedllm.entrypoints import cli, serve_setup
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.pooling.encoder_server import EncoderEngineClient
from pagedllm.utils import free_port
from tests.entrypoints.live_server import uvicorn_thread
from tests.pooling.test_encoder_dispatch import _Pair, _Runner, install_stand_in


class _Tokenizer(_Pair):
    def __len__(self) -> int:
        return 100


class _Embedder(_Runner):
    """Embeds ``[len(tokens), first token]``; each call takes a while (so requests pile up), and a
    token 99 makes the runner refuse its whole batch."""

    def __init__(self) -> None:
        super().__init__(_Tokenizer())
        self.supported_tasks = ("embed", "encode")
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def run(self, inputs):
        if not self.lock.acquire(blocking=False):
            raise RuntimeError("the runner was called from two threads at once")
        try:
            time.sleep(0.1)
            if any(99 in i.token_ids for i in inputs):
                raise ValueError("token 99 is refused")
            self.calls.append(len(inputs))
            return [torch.tensor([float(len(i.token_ids)), float(i.token_ids[0])]) for i in inputs]
        finally:
            self.lock.release()


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The encoder-runner module as the contract has it; ``tmp_path`` its checkpoint, run by ``_Embedder``."""
    runner = _Embedder()
    install_stand_in(monkeypatch, runner, tmp_path)
    return runner


@pytest.fixture
def server(stand_in):
    state = ServerState(async_engine=EncoderEngineClient(stand_in), served_model_name="enc")
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        yield f"http://127.0.0.1:{port}", stand_in


def test_concurrent_clients_share_batches_and_get_their_own_vectors(server):
    base, runner = server
    texts = [" ".join(["w"] * (1 + i % 7)) for i in range(16)]

    def embed(text: str) -> list[float]:
        answer = httpx.post(f"{base}/v1/embeddings", json={"input": text}, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()["data"][0]["embedding"]

    with ThreadPoolExecutor(16) as pool:
        vectors = list(pool.map(embed, texts))
    assert vectors == [[float(len(t.split()) + 2), 1.0] for t in texts]  # [CLS] words [SEP]
    assert sum(runner.calls) == len(texts) and len(runner.calls) < len(texts)  # requests shared runner calls
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert f"pagedllm:pooling_requests_total {float(len(texts))}" in metrics


def test_a_refused_input_fails_its_own_request_only(server):
    base, _ = server
    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.map(lambda ids: httpx.post(f"{base}/v1/embeddings", json={"input": ids}, timeout=30),
                             [[5, 99], [5, 6]])
    assert bad.status_code == 400 and "token 99" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["data"][0]["embedding"] == [2.0, 5.0]


def test_admin_routes_of_a_server_without_a_pool(server):
    base, _ = server
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]] == ["enc"]
    pool = httpx.get(f"{base}/v1/kv_pool", timeout=30)
    assert pool.status_code == 404 and "no block pool" in pool.json()["error"]["message"]
    generation = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert generation.status_code == 400 and "without --runner pooling" in generation.json()["error"]["message"]
    too_long = httpx.post(f"{base}/v1/embeddings", json={"input": "x " * 40}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "truncate_prompt_tokens"
    score = httpx.post(f"{base}/score", json={"text_1": "a", "text_2": "b"}, timeout=30)
    assert score.status_code == 400 and "does not support the 'score' task" in score.json()["error"]["message"]


def test_pagedllm_serve_runs_an_encoder_folder_without_an_engine(stand_in, monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    served = {}
    monkeypatch.setattr(serve_setup, "run_uvicorn", lambda app, options, *_: served.update(app=app))
    monkeypatch.setattr(cli, "make_llm", lambda *a, **k: pytest.fail("an encoder server builds no engine"))
    cli.main(["serve", str(tmp_path), "--runner", "pooling"])
    with TestClient(served["app"]) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        answer = client.post("/v1/embeddings", json={"input": ["a b", "c"]}).json()
    assert [d["embedding"] for d in answer["data"]] == [[4.0, 1.0], [3.0, 1.0]]

"""A client that goes away before its whole (non-streamed) answer is ready stops
its engine request: the blocks come back and generation ends well short of
max_tokens (vLLM's ``with_cancellation``). On a real socket, since only a real
connection can be dropped."""

from __future__ import annotations

import time

import httpx
import pytest

from pagedllm import LLM
from pagedllm.bench.soak import metric_value
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.utils import free_port
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import assert_server_pool_free, uvicorn_thread

MAX_TOKENS = 3000  # seconds of decoding for the tiny model: far longer than the client waits
GENERATED = "pagedllm:generation_tokens_total"


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=256, max_model_len=4096)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name="tiny")
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        base = f"http://127.0.0.1:{port}"
        # one request first, so the generated-tokens counter has its series
        httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1}, timeout=60)
        yield base
    assert_pool_free(llm)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story"}]}),
])
def test_a_client_that_leaves_aborts_its_whole_answer(server, path, body):
    before = metric_value(httpx.get(f"{server}/metrics").text, GENERATED)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}{path}", json={"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                            "temperature": 0, **body}, timeout=0.5)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/v1/kv_pool").json()["counters"]["num_running"]:
        assert time.monotonic() < deadline, "the request still runs after its client left"
        time.sleep(0.05)
    generated = metric_value(httpx.get(f"{server}/metrics").text, GENERATED) - before
    assert 0 < generated < MAX_TOKENS / 2
    assert_server_pool_free(server)

"""The OpenAI-compatible server, live on 127.0.0.1 with the real default model,
driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from pagedllm.bench.server_process import running_server
from pagedllm.bench.soak import metric_value

API_KEY = "test-key"
TENANTS = {"key-alpha": "alpha", "key-beta": "beta"}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(TENANTS))
    args = ["--num-kv-blocks", "768", "--api-key", API_KEY, "--api-keys-file", str(keys_file)]
    with running_server(args, start_timeout_s=180) as (base, _pid):
        yield base


def client(base: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def metric(base: str, name: str) -> float:
    return metric_value(httpx.get(f"{base}/metrics").text, name)


IDLE_GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_used_blocks")


def wait_until_idle(base: str) -> None:
    """Every request gone and every block free, within a minute. All three gauges
    are read from one scrape and must be zero together: between two aborts the
    pool can read "nothing running, nothing held" while requests still wait."""
    deadline = time.time() + 60
    while busy := busy_gauges(base):
        assert time.time() < deadline, f"still not idle after a minute: {busy}"
        time.sleep(0.2)


def busy_gauges(base: str) -> list[str]:
    scrape = httpx.get(f"{base}/metrics").text
    return [name for name in IDLE_GAUGES if metric_value(scrape, name)]


def test_completion_streamed_equals_non_streamed(server):
    c = client(server)
    full = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == 5
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                       temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    wait_until_idle(server)


def test_chat_streaming_and_not(server):
    c = client(server)
    messages = [{"role": "user", "content": "Name a color."}]
    full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content
    wait_until_idle(server)


def test_n2_seeds_and_stop_strings(server):
    c = client(server)
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42, n=2)
    first, again = c.completions.create(**kwargs), c.completions.create(**kwargs)
    assert [ch.index for ch in first.choices] == [0, 1]
    assert [ch.text for ch in first.choices] == [ch.text for ch in again.choices]
    assert first.choices[0].text != first.choices[1].text
    greedy = c.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=20, temperature=0).choices[0]
    stop = greedy.text.strip().split()[1]
    stopped = c.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=20, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and greedy.text.startswith(stopped.choices[0].text)
    wait_until_idle(server)


def test_errors_have_openai_shape_and_the_server_carries_on(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert bad.value.status_code == 400
    assert set(bad.value.response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        c.completions.create(model=MODEL, prompt=[5] * 9000, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", temperature="hot")
    invalid_json = httpx.post(f"{server}/v1/completions", content=b"{not json",
                              headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert invalid_json.status_code == 400 and invalid_json.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    wait_until_idle(server)


def test_api_key_is_enforced_but_health_is_open(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    wait_until_idle(server)


def test_tenants_never_share_prefix_blocks(server):
    prompt = "You are a careful assistant for a bank. " * 8 + "What is my balance?"
    usage = {}
    for key, salt in (("key-alpha", None), ("key-beta", "tenant:alpha"), ("key-alpha", "whatever")):
        # A client-sent cache_salt cannot pick another tenant's blocks: the server overrides it.
        extra = {"cache_salt": salt} if salt else {}
        response = client(server, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                                          temperature=0, extra_body=extra)
        usage.setdefault(key, []).append(response.usage.prompt_tokens_details.cached_tokens)
    assert usage["key-beta"] == [0]
    assert usage["key-alpha"][0] == 0 and usage["key-alpha"][1] > 0
    wait_until_idle(server)


def test_tokenize_and_detokenize(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == "Hello world"
    wait_until_idle(server)


def test_32_streaming_clients_with_8_disconnects(server):
    async def one(i: int) -> str | None:
        c = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        stream = await c.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=24,
                                            temperature=0.8, seed=i, stream=True)
        finish = None
        received = 0
        async for chunk in stream:
            received += 1
            if i % 4 == 0 and received == 3:
                await stream.close()  # this client goes away mid-stream
                break
            finish = chunk.choices[0].finish_reason or finish
        await c.close()
        return finish

    async def all_clients():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(all_clients())
    finished = [r for i, r in enumerate(results) if i % 4 != 0]
    assert len(finished) == 24 and all(r == "length" for r in finished)
    wait_until_idle(server)
    assert metric(server, "pagedllm:kv_cache_usage_perc") == 0.0
    assert httpx.post(f"{server}/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert metric(server, "pagedllm:kv_cache_free_blocks") == metric(server, "pagedllm:kv_cache_total_blocks")


def _bodies():
    """Request bodies mixing valid fields, wrong types and bad values."""
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(-2, 3, allow_nan=False),
                        st.text(max_size=8), st.just(2**70))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=5), inner, max_size=3), max_leaves=6)
    fields = {
        "model": st.sampled_from([MODEL, MODEL, "gpt-17", 3]),
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 60000), max_size=6), values),
        "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                                               "content": st.text(max_size=20)}), max_size=2),
                              values),
        "temperature": st.one_of(st.sampled_from([0, 0.5, -1, "hot"]), values),
        "top_p": st.sampled_from([0, 0.5, 1, 1.5]),
        "n": st.sampled_from([0, 1, 2, 10**6, "2"]),
        "stream": st.booleans(),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5), values),
        "logprobs": st.sampled_from([None, 0, 2, 100, True]),
        "seed": st.one_of(st.integers(-5, 2**64), st.text(max_size=3)),
        "priority": st.integers(-3, 3),
    }
    # max_tokens is always sent: without it a chat completion may run to
    # max_model_len (as OpenAI's API allows), minutes of CPU per example.
    return st.fixed_dictionaries({"max_tokens": st.sampled_from([-1, 0, 1, 2, 3, "x", 2.5])}, optional=fields)


def test_fuzzed_request_bodies_never_get_a_5xx(server):
    """Random bodies, valid or not, on both generation endpoints: every answer is a
    200 or an OpenAI-style 4xx, the server stays up, and nothing leaks."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    headers = {"Authorization": f"Bearer {API_KEY}"}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=_bodies())
    def check(path, body):
        response = httpx.post(f"{server}{path}", json=body, headers=headers, timeout=120)
        assert response.status_code in (200, 400, 404), (body, response.status_code, response.text[:300])
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["message"] and error["type"], error

    check()
    # Bytes that are not UTF-8, and JSON that is not an object.
    for content in (b"\xff\xfe\x00garbage", b"[1, 2, 3]", b"42", b'"prompt"'):
        response = httpx.post(f"{server}/v1/completions", content=content,
                              headers={**headers, "Content-Type": "application/json"})
        assert response.status_code == 400, (content, response.status_code, response.text[:300])
    assert httpx.get(f"{server}/health").status_code == 200
    wait_until_idle(server)


def test_disconnects_while_queued_and_in_prefill_leak_nothing(server):
    """Clients that go away before their first token (waiting in the queue, or
    while their long prompt is being prefilled) are aborted like those that leave
    mid-decode: no block stays in use and the server keeps serving."""
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def leave_after(delay_s: float, index: int) -> bool:
        """True when the client left before the stream finished."""
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=None) as c:
            request = {**body, "prompt": [400 + index] * 3000}  # 3000 tokens: two prefill steps each
            try:
                async with asyncio.timeout(delay_s):
                    async with c.stream("POST", "/v1/completions", json=request) as response:
                        async for line in response.aiter_lines():
                            if line == "data: [DONE]":
                                return False
            except TimeoutError:
                return True
            return False

    async def all_clients():
        # Eight long prompts at once: the first ones prefill while the rest queue.
        return await asyncio.gather(*(leave_after(0.2 + 0.3 * i, i) for i in range(8)))

    assert sum(asyncio.run(all_clients())) >= 6
    wait_until_idle(server)
    assert metric(server, "pagedllm:kv_cache_used_blocks") == 0
    assert client(server).completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    wait_until_idle(server)


def test_idle_connections_do_not_block_the_server_and_are_closed(server):
    """Slowloris-style clients (a half-sent request, an idle keep-alive
    connection) do not stop others from being served; an idle keep-alive
    connection is closed after --timeout-keep-alive (5 s by default)."""
    host, port = server.removeprefix("http://").split(":")
    half_sent = []
    for _ in range(20):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")  # never finished
        half_sent.append(sock)
    try:
        start = time.time()
        assert httpx.get(f"{server}/health", timeout=10).status_code == 200
        assert time.time() - start < 5
        idle = socket.create_connection((host, int(port)))
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        idle.settimeout(15)
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):  # the whole answer, headers and body
            chunk = idle.recv(4096)
            assert chunk, answer
            answer += chunk
        assert b"200" in answer.split(b"\r\n", 1)[0]
        assert idle.recv(4096) == b"", "the server should close an idle keep-alive connection"
        idle.close()
    finally:
        for sock in half_sent:
            sock.close()


def test_kv_pool_shows_an_n4_request_sharing_its_prompt(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server}/v1/kv_pool").status_code == 401  # the pool view needs the key too
    prompt = "A long prompt about paging. " * 12  # several full blocks
    body = {"model": MODEL, "prompt": prompt, "n": 4, "max_tokens": 3000, "temperature": 1.0, "seed": 3,
            "stream": True, "ignore_eos": True}  # still running when the pool is read; closing aborts it
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generation is under way
        pool = httpx.get(f"{server}/v1/kv_pool", headers=headers).json()
    shared = [b for b in pool["blocks"] if b["ref_cnt"] == 4]
    assert shared and all(b["state"] == "used" and b["hashed"] and len(b["owners"]) == 4 for b in shared)
    assert pool["num_blocks"] == 768 and pool["counters"]["blocks_in_use"] >= len(shared)
    wait_until_idle(server)


def test_kv_pool_shows_two_same_prefix_requests_sharing_blocks(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prefix = "You are a careful assistant who answers in full sentences. " * 8  # several full blocks
    # Long enough to be still running when the pool is read (SmolLM2 makes ~200 tokens a second
    # here); closing the streams aborts them.
    body = {"model": MODEL, "max_tokens": 3000, "temperature": 1.0, "seed": 1, "stream": True, "ignore_eos": True}
    httpx.post(f"{server}/v1/completions", json={**body, "prompt": prefix + "Hi.", "max_tokens": 1, "stream": False},
               headers=headers, timeout=120)  # caches the prefix blocks
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "prompt": prefix + "Question one?"},
                      headers=headers, timeout=120) as first, \
            httpx.stream("POST", f"{server}/v1/completions", json={**body, "prompt": prefix + "Question two?"},
                         headers=headers, timeout=120) as second:
        # Keep the line iterators: one that is dropped closes its stream (and aborts the request).
        first_lines, second_lines = first.iter_lines(), second.iter_lines()
        next(line for line in first_lines if line.startswith("data: "))
        next(line for line in second_lines if line.startswith("data: "))
        pool = httpx.get(f"{server}/v1/kv_pool", headers=headers).json()
    shared = [b for b in pool["blocks"] if b["ref_cnt"] == 2]
    assert len(shared) >= 3, [(b["ref_cnt"], b["owners"]) for b in pool["blocks"] if b["state"] == "used"]
    assert all(b["state"] == "used" and b["hashed"] and len(set(b["owners"])) == 2 for b in shared)
    assert pool["counters"]["prefix_cache_hit_rate"] > 0
    wait_until_idle(server)

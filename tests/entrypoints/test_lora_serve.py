"""LoRA adapters served as vLLM serves them: `pagedllm serve --enable-lora --lora-modules`,
a request's ``model`` selecting the adapter, /v1/models listing them, the run-time load and
unload endpoints, and the router hashing an adapter's blocks as the replica does.

One live server (its own engine-core process) on the tiny random Llama with two PEFT
adapters; greedy tokens are checked against Hugging Face + PEFT (``tests/lora/adapters.py``),
through the official ``openai`` client, and every test ends with the server's pool all free.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm.bench.server_process import free_port, running_server
from pagedllm.core.block_hash import hash_request_tokens
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.openai.admin.lora import LoRAModulePath, parse_lora_modules
from pagedllm.entrypoints.router.replica import Replica, take_hashing_names
from pagedllm.entrypoints.openai.common.routes import COMPLETIONS as COMPLETION_PATH
from pagedllm.entrypoints.router.request_prefix import routing_lora_name, routing_token_ids
from pagedllm.entrypoints.router.router_app import RouterState, build_router_app
from pagedllm.fleet.routing import RoutingPolicy
from pagedllm.lora.adapter_files import adapter_fingerprint
from pagedllm.model.loader import load_tokenizer
from tests.entrypoints.live_server import assert_server_pool_free
from tests.entrypoints.test_serve_ops import ready
from tests.lora.adapters import make_peft_adapter, peft_greedy

BASE = "tiny"
MAX_TOKENS = 8
PROMPTS = ["The history of paged memory begins", "Three facts about rivers:"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Two adapters of different shapes: every projection at rank 8, and q/v only at rank 4."""
    root = tmp_path_factory.mktemp("served-adapters")
    return {
        "adapter-a": make_peft_adapter(tiny_llama, str(root / "a"), rank=8, seed=1),
        "adapter-b": make_peft_adapter(tiny_llama, str(root / "b"), rank=4, targets=("q_proj", "v_proj"), seed=2),
    }


def peft_oracle(tiny_llama: str, adapters: dict[str, str]) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens of each prompt, for the base (None) and each adapter."""
    return {name: peft_greedy(tiny_llama, None if name is None else adapters[name], PROMPTS, MAX_TOKENS)
            for name in (None, *adapters)}


@pytest.fixture(scope="module")
def served(tiny_llama, adapters):
    """(base URL, the oracle's future) of a server with adapter-a (name=path) and adapter-b (vLLM's
    JSON form) loaded at start-up; PEFT computes the oracle while the server starts."""
    modules = [f"adapter-a={adapters['adapter-a']}",
               json.dumps({"name": "adapter-b", "path": adapters["adapter-b"], "base_model_name": BASE})]
    args = [tiny_llama, "--served-model-name", BASE, "--num-kv-blocks", "256", "--enable-lora",
            "--max-lora-rank", "8", "--lora-modules", *modules, "--disable-log-stats"]
    with ThreadPoolExecutor(1) as background:
        oracle = background.submit(peft_oracle, tiny_llama, adapters)
        with running_server(args, start_timeout_s=180) as (base, _pid):
            yield base, oracle
            assert_server_pool_free(base)


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def oracle(served) -> dict[str | None, list[list[int]]]:
    return served[1].result()


@pytest.fixture
def client(server) -> openai.OpenAI:
    yield openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    assert_server_pool_free(server)


# A greedy completion whose logprobs name each generated token as "token_id:N".
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True}


def ids_of(tokens: list[str]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in tokens]


def greedy(client: openai.OpenAI, model: str, prompt: str) -> list[int]:
    """The generated token ids of a greedy completion through the openai client."""
    answer = client.completions.create(model=model, prompt=prompt, extra_body=GREEDY)
    return ids_of(answer.choices[0].logprobs.tokens)


def test_the_model_field_selects_the_adapter_and_each_equals_peft(client, oracle):
    assert oracle["adapter-a"] != oracle[None] and oracle["adapter-b"] != oracle[None]
    for model, name in ((BASE, None), ("adapter-a", "adapter-a"), ("adapter-b", "adapter-b")):
        assert [greedy(client, model, prompt) for prompt in PROMPTS] == oracle[name], model
    chat = client.chat.completions.create(model="adapter-a", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "adapter-a" and chat.choices[0].message.content is not None


def test_concurrent_requests_of_both_adapters_and_the_base_each_equal_their_oracle(client, oracle):
    jobs = [(model, index) for _ in range(2) for model in (BASE, "adapter-a", "adapter-b")
            for index in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: greedy(client, job[0], PROMPTS[job[1]]), jobs))
    for (model, index), tokens in zip(jobs, got):
        assert tokens == oracle[None if model == BASE else model][index], (model, index)


def test_models_lists_the_adapters_after_the_base(client, server, tiny_llama, adapters):
    data = httpx.get(f"{server}/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data] == [(BASE, tiny_llama, None),
                                                              ("adapter-a", adapters["adapter-a"], BASE),
                                                              ("adapter-b", adapters["adapter-b"], BASE)]
    assert all(m["object"] == "model" and m["max_model_len"] == data[0]["max_model_len"] for m in data)
    assert [m.id for m in client.models.list().data] == [BASE, "adapter-a", "adapter-b"]
    tokens = httpx.post(f"{server}/tokenize", json={"model": "adapter-b", "prompt": "Hi"})
    assert tokens.status_code == 200 and tokens.json()["count"] >= 1


def test_unknown_model_is_the_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="adapter-z", prompt="Hi", max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'adapter-z' does not exist" in error["message"] and "'adapter-a'" in error["message"]


def load(server: str, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def unload(server: str, name: str) -> httpx.Response:
    return httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_load_and_unload_at_run_time(client, server, adapters, oracle, tmp_path):
    loaded = load(server, "adapter-c", adapters["adapter-b"])
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'adapter-c' added successfully."
    assert [greedy(client, "adapter-c", prompt) for prompt in PROMPTS] == oracle["adapter-b"]
    assert [m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]][-1] == "adapter-c"

    missing = str(tmp_path / "no-such-adapter")
    refusals = {"bad path": (load(server, "adapter-d", missing), "lora_path", missing),
                "taken name": (load(server, "adapter-a", adapters["adapter-b"]), "lora_name", "already been loaded"),
                "base name": (load(server, BASE, adapters["adapter-b"]), "lora_name", "base model"),
                "unknown unload": (unload(server, "adapter-d"), "lora_name", "cannot be found")}
    for case, (answer, param, text) in refusals.items():
        assert answer.status_code == 400, case
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and text in error["message"], case

    # Refused while a request of the adapter runs (it reads the adapter's pages); served still.
    stream_body = {"model": "adapter-c", "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=stream_body, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the connection, aborting the request
        assert next(lines).startswith("data: {")
        busy = unload(server, "adapter-c")
    assert busy.status_code == 400 and "unfinished requests" in busy.json()["error"]["message"]
    assert_server_pool_free(server)  # the closed stream's request is aborted
    removed = unload(server, "adapter-c")
    assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'adapter-c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="adapter-c", prompt=PROMPTS[0], max_tokens=2)
    # The engine forgot the name: it loads again from another path, and serves the new weights.
    assert load(server, "adapter-c", adapters["adapter-a"]).status_code == 200
    assert [greedy(client, "adapter-c", prompt) for prompt in PROMPTS] == oracle["adapter-a"]
    assert unload(server, "adapter-c").status_code == 200


def test_a_reloaded_name_never_reuses_blocks_cached_under_its_old_weights(client, server, adapters, oracle):
    """After an unload, a new adapter of the same name neither revives the old one's resident pages
    nor finds the blocks cached under its weights (the prompt fills several cached blocks)."""
    prompt = " ".join(PROMPTS * 6)

    def text(model: str):
        return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)

    assert load(server, "adapter-e", adapters["adapter-a"]).status_code == 200
    first, again = text("adapter-e"), text("adapter-e")
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 and again.choices[0].text == first.choices[0].text
    assert unload(server, "adapter-e").status_code == 200
    assert load(server, "adapter-e", adapters["adapter-b"]).status_code == 200
    reloaded, under_b = text("adapter-e"), text("adapter-b")
    assert under_b.choices[0].text != first.choices[0].text  # else this test could not tell the weights apart
    assert reloaded.usage.prompt_tokens_details.cached_tokens == 0
    assert reloaded.choices[0].text == under_b.choices[0].text
    assert unload(server, "adapter-e").status_code == 200


def test_the_router_hashes_an_adapters_blocks_as_the_replica_stores_them(client, server, tiny_llama, adapters):
    """The router's hashes of a completion naming adapter-a (its model field; the base names and the
    adapter's fingerprint from the replica's /server_info) are the block hashes the replica's pool
    holds after serving it (the pool's hashes are those its KV events publish)."""
    body = {"model": "adapter-a", "prompt": " ".join(PROMPTS * 4), "max_tokens": 1, "temperature": 0}
    assert httpx.post(f"{server}/reset_prefix_cache").status_code == 200
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200
    held = {block["block_hash"] for block in httpx.get(f"{server}/v1/kv_pool").json()["blocks"] if block["hashed"]}
    info = httpx.get(f"{server}/server_info").json()
    assert info["model_names"] == [BASE] and info["lora_adapters"] == {
        name: adapter_fingerprint(path) for name, path in adapters.items()}
    replica = Replica(0, server)
    take_hashing_names(replica, info)  # what the router's watch reads at join
    router = RouterState(replicas=[replica], policy=RoutingPolicy(), tokenizer=load_tokenizer(tiny_llama),
                         fingerprint=info["prompt_fingerprint"])
    routed = router.routing_hashes(COMPLETION_PATH, body, None, replica)
    assert len(routed) >= 2 and set(routed) <= held
    token_ids = routing_token_ids(COMPLETION_PATH, body, router.tokenizer, None)
    assert routed == hash_request_tokens(token_ids, 16, None, "adapter-a", info["lora_adapters"]["adapter-a"])
    # The name alone is not the key (the engine adds the files' digest); the base's never hits either.
    assert not set(hash_request_tokens(token_ids, 16, None, "adapter-a")) & held
    assert not set(hash_request_tokens(token_ids, 16)) & held
    assert routing_lora_name({"model": BASE}, replica.model_names) is None
    assert routing_lora_name({}, replica.model_names) is None


def test_lora_modules_items_and_their_errors():
    assert parse_lora_modules(["sql=/p/sql", '{"name": "x", "path": "/p/x", "base_model_name": "m"}']) == [
        LoRAModulePath("sql", "/p/sql"), LoRAModulePath("x", "/p/x", "m")]
    for bad, why in (("sql", "name=path"), ("=/p", "name=path"), ('{"name": "x"}', "JSON item"),
                     ('{"name": "x", "path": "/p", "rank": 8}', "JSON item"), ("{oops", "invalid JSON")):
        with pytest.raises(ValueError, match=why):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/p", "a=/q"])


@pytest.mark.parametrize("flags, why", [(["--lora-modules", "a=/nowhere"], "--lora-modules needs --enable-lora"),
                                        (["--enable-lora", "--lora-modules", "a"], "give name=path")])
def test_lora_flags_are_checked_before_the_server_starts(tiny_llama, capsys, flags, why):
    with pytest.raises(SystemExit) as exited:
        main(["serve", tiny_llama, *flags])
    assert exited.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.slow
def test_a_bad_lora_module_stops_the_server_with_its_message(tiny_llama, tmp_path):
    missing = str(tmp_path / "missing-adapter")
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_llama, "--num-kv-blocks", "64",
               "--enable-lora", "--lora-modules", f"bad={missing}", "--port", str(free_port())]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 1, finished.stderr[-2000:]
    assert f"--lora-modules bad={missing}" in finished.stderr and missing in finished.stderr


def test_the_router_loads_and_unloads_an_adapter_on_every_replica_up():
    """No server: fake replicas behind the router's app. A load goes to every replica up, the first
    refusal is the answer, and the adapters' fingerprints are read again at once for routing."""
    posted: list[tuple[int, str]] = []
    loaded: dict[str, str] = {}

    def replica(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"model": BASE, "model_names": [BASE], "lora_adapters": loaded})
        body = json.loads(request.content)
        posted.append((request.url.port, request.url.path))
        if request.url.port == 2 and body["lora_name"] == "bad":
            return httpx.Response(400, json={"error": {"message": "refused", "type": "invalid_request_error",
                                                       "param": "lora_path", "code": None}})
        loaded[body["lora_name"]] = "f00d"
        return httpx.Response(200, text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    replicas = [Replica(0, "http://replica:1"), Replica(1, "http://replica:2"), Replica(2, "http://replica:3")]
    replicas[0].up = replicas[1].up = True  # replica 2 is down: nothing is sent to it
    state = RouterState(replicas=replicas, policy=RoutingPolicy("round-robin"), tokenizer=None, fingerprint="")
    router = TestClient(build_router_app(state, httpx.AsyncClient(transport=httpx.MockTransport(replica))))
    answer = router.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/p"})
    assert answer.status_code == 200 and answer.text.startswith("Success")
    assert sorted(posted) == [(1, "/v1/load_lora_adapter"), (2, "/v1/load_lora_adapter")]
    assert replicas[0].lora_fingerprints == replicas[1].lora_fingerprints == {"sql": "f00d"}
    assert replicas[2].lora_fingerprints == {}
    refused = router.post("/v1/unload_lora_adapter", json={"lora_name": "bad"})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "refused"
    assert sorted(posted[2:]) == [(1, "/v1/unload_lora_adapter"), (2, "/v1/unload_lora_adapter")]


def test_the_in_process_engine_serves_adapters_too(serve, adapters, oracle):
    """--no-engine-process: start-up and run-time adapters through AsyncLLMEngine."""
    app, _options, _made = serve("--served-model-name", BASE, "--enable-lora", "--max-lora-rank", "8",
                                 "--lora-modules", f"adapter-a={adapters['adapter-a']}")
    with ready(app) as http:
        def tokens(model: str) -> list[int]:
            answer = http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], **GREEDY})
            return ids_of(answer.json()["choices"][0]["logprobs"]["tokens"])

        assert tokens("adapter-a") == oracle["adapter-a"][0] and tokens(BASE) == oracle[None][0]
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "adapter-b", "lora_path": adapters["adapter-b"]})
        assert loaded.status_code == 200 and tokens("adapter-b") == oracle["adapter-b"][0]
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_path"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "adapter-b"}).status_code == 200
        assert http.post("/v1/completions", json={"model": "adapter-b", "prompt": "Hi"}).status_code == 404

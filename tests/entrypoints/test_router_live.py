"""`pagedllm router` in front of two real `pagedllm serve` replicas (tiny random
Llama, KV events on): prefix routing seen in the replicas' own cached-token
counts, tenants kept apart, every path passed through, and faults: a hung
replica and a killed one fail only their own requests, and come back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from pagedllm.utils import free_port
from tests.entrypoints.live_server import assert_server_pool_free

pytestmark = pytest.mark.slow

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}
SYSTEMS = ["You are a careful assistant for a shipping company. Answer briefly and politely. " * 4,
           "You are a terse pirate who answers every question about the sea with a riddle. " * 4]


@contextlib.contextmanager
def process(command: list[str], log_name: str) -> Iterator[subprocess.Popen]:
    with tempfile.NamedTemporaryFile("w+", prefix=log_name, suffix=".log", delete=False) as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield child
        finally:
            stop_tree(child.pid)
            os.unlink(log.name)


def stop_tree(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        tree = [parent, *parent.children(recursive=True)]
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        psutil.wait_procs(tree, timeout=30)
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def replica_command(model: str, keys_file: str, port: int, events_port: int) -> list[str]:
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://*:{events_port + 1}"}
    return [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "m", "--num-kv-blocks", "128", "--num-threads", "1", "--api-keys-file", keys_file,
            "--kv-events-config", json.dumps(events), "--disable-log-stats", "--uvicorn-log-level", "warning"]


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def replicas_up(router: str) -> int:
    answer = httpx.get(f"{router}/health", timeout=5)
    return answer.json().get("replicas_up", 0) if answer.status_code == 200 else 0


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    ports = [free_port() for _ in range(2)]
    events_ports = [free_port() for _ in range(2)]
    commands = [replica_command(tiny_llama, str(keys_file), p, e) for p, e in zip(ports, events_ports)]
    router_port = free_port()
    router_command = [sys.executable, "-m", "pagedllm.cli", "router", "--model", tiny_llama, "--host", "127.0.0.1",
                      "--port", str(router_port), "--api-keys-file", str(keys_file), "--health-interval", "0.25",
                      "--uvicorn-log-level", "warning",
                      *[arg for p in ports for arg in ("--replica", f"http://127.0.0.1:{p}")]]
    with contextlib.ExitStack() as stack:
        children = [stack.enter_context(process(c, f"replica{i}-")) for i, c in enumerate(commands)]
        stack.enter_context(process(router_command, "router-"))
        router = f"http://127.0.0.1:{router_port}"
        wait_until(lambda: replicas_up(router) == 2, 180, "the router never saw both replicas up")
        yield {"router": router, "replicas": [f"http://127.0.0.1:{p}" for p in ports], "children": children,
               "commands": commands, "stack": stack}


def chat(base: str, system: str, question: str, headers: dict, max_tokens: int = 6) -> dict:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def model_id(base: str) -> str:
    return httpx.get(f"{base}/v1/models", headers=ALICE).json()["data"][0]["id"]


def routed(router: str) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{router}/metrics").text.splitlines():
        if line.startswith("pagedllm:router_requests_routed_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].split(","))
            counts[(labels["replica"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return counts


def test_prefix_routing_keeps_each_system_prompt_on_one_replica(fleet):
    router, replicas = fleet["router"], fleet["replicas"]
    for replica in replicas:
        httpx.post(f"{replica}/reset_prefix_cache", headers=ALICE)
    cached: dict[int, list[int]] = {0: [], 1: []}
    for round_ in range(3):
        for which, system in enumerate(SYSTEMS):
            usage = chat(router, system, f"Question number {round_}?", ALICE)["usage"]
            cached[which].append(usage["prompt_tokens_details"]["cached_tokens"])
    # Round-robin would send each prompt's second request to the other replica (nothing cached there).
    for which in (0, 1):
        assert cached[which][0] == 0 and min(cached[which][1:]) >= 64, cached
    counts = routed(router)
    assert sum(v for (_, reason), v in counts.items() if reason == "prefix") >= 4, counts
    # Another tenant's identical prompt shares nothing: its salt differs, so no replica "holds" it.
    bob = chat(router, SYSTEMS[0], "Question number 0?", BOB)
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The router changes no token: the same request straight to a replica gives the same text.
    direct = chat(replicas[0], SYSTEMS[1], "Question number 2?", ALICE)
    assert chat(router, SYSTEMS[1], "Question number 2?", ALICE)["choices"][0]["message"]["content"] == \
        direct["choices"][0]["message"]["content"]
    for replica in replicas:
        assert_server_pool_free(replica, ALICE)


def test_the_responses_and_messages_apis_route_by_prefix_and_a_stored_response_stays_home(fleet):
    router, replicas = fleet["router"], fleet["replicas"]
    for replica in replicas:
        httpx.post(f"{replica}/reset_prefix_cache", headers=ALICE)
    cached = []
    for round_ in range(2):
        messages = {"model": "m", "max_tokens": 4, "temperature": 0, "system": SYSTEMS[0],
                    "messages": [{"role": "user", "content": f"Question number {round_}?"}]}
        answer = httpx.post(f"{router}/v1/messages", json=messages, headers={"x-api-key": "key-alice"}, timeout=60)
        assert answer.status_code == 200, answer.text
        cached.append(answer.json()["usage"]["cache_read_input_tokens"])
    assert cached[0] == 0 and cached[1] >= 64, cached  # the second went where the first left its prefix
    first = httpx.post(f"{router}/v1/responses", headers=ALICE, timeout=60, json={
        "model": "m", "instructions": SYSTEMS[1], "input": "Hello?", "max_output_tokens": 4, "temperature": 0})
    assert first.status_code == 200, first.text
    before = routed(router)
    follow_ups = [httpx.post(f"{router}/v1/responses", headers=ALICE, timeout=60, json={
        "model": "m", "input": f"And then {i}?", "previous_response_id": first.json()["id"], "max_output_tokens": 4,
        "stream": i % 2 == 1}) for i in range(4)]
    assert all(answer.status_code == 200 for answer in follow_ups), [a.text for a in follow_ups]
    fetched = httpx.get(f"{router}/v1/responses/{first.json()['id']}", headers=ALICE, timeout=30)
    assert fetched.status_code == 200 and fetched.json()["id"] == first.json()["id"]
    homes = {key: value - before.get(key, 0) for key, value in routed(router).items() if key[1] == "response-home"}
    assert sum(homes.values()) == 5 and len([v for v in homes.values() if v]) == 1, homes  # all to one replica
    # Another tenant cannot read it, through the router either.
    assert httpx.get(f"{router}/v1/responses/{first.json()['id']}", headers=BOB, timeout=30).status_code == 404
    for replica in replicas:
        assert_server_pool_free(replica, ALICE)


def test_every_path_passes_through_and_the_router_merges_models_and_metrics(fleet):
    router = fleet["router"]
    body = {"model": model_id(router), "prompt": "Tell me about ships", "max_tokens": 8, "temperature": 0}
    whole = httpx.post(f"{router}/v1/completions", json=body, headers=ALICE, timeout=60).json()
    pieces = []
    with httpx.stream("POST", f"{router}/v1/completions", json={**body, "stream": True}, headers=ALICE,
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == whole["choices"][0]["text"]
    tokens = httpx.post(f"{router}/tokenize", json={"model": body["model"], "prompt": "ships"}, headers=ALICE).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    refused = httpx.post(f"{router}/v1/completions", json=body)  # no key: the replica's own 401 comes back
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    models = httpx.get(f"{router}/v1/models", headers=ALICE).json()["data"]
    assert len(models) == 1
    metrics = httpx.get(f"{router}/metrics").text
    assert 'replica="0"' in metrics and 'replica="1"' in metrics
    assert 'pagedllm:router_replica_up{replica="1"} 1.0' in metrics
    # A reset through the router resets every replica's cache.
    for system in SYSTEMS:
        chat(router, system, "Anything cached?", ALICE)
    cached_before = [httpx.get(f"{r}/v1/kv_pool", headers=ALICE).json()["counters"]["cached_blocks"]
                     for r in fleet["replicas"]]
    reset = httpx.post(f"{router}/reset_prefix_cache", headers=ALICE)
    assert reset.status_code == 200 and reset.json()["dropped_blocks"] == sum(cached_before) > 0
    assert all(httpx.get(f"{r}/v1/kv_pool", headers=ALICE).json()["counters"]["cached_blocks"] == 0
               for r in fleet["replicas"])
    for replica in fleet["replicas"]:
        assert_server_pool_free(replica, ALICE)


def long_stream(router: str, outcome: dict) -> None:
    """A stream that runs for a long time; records its last event."""
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, headers=ALICE, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                outcome.setdefault("first", time.monotonic())
                outcome["last"] = line[6:]
    outcome["ended"] = time.monotonic()


def failed_counts(router: str) -> dict[str, float]:
    prefix = 'pagedllm:router_requests_failed_total{replica="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{router}/metrics").text.splitlines() if line.startswith(prefix)}


def steady_traffic(router: str, answers: list[httpx.Response], stop: threading.Event) -> None:
    """Chat requests one after another until ``stop``: the load the fault must not lose."""
    n = 0
    while not stop.is_set():
        body = {"model": "m", "messages": [{"role": "user", "content": f"Traffic {n}?"}], "max_tokens": 4,
                "temperature": 0}
        answers.append(httpx.post(f"{router}/v1/chat/completions", json=body, headers=ALICE, timeout=60))
        n += 1


def stream_then_fault(fleet, fault, want_replica_up: int = 1) -> tuple[dict, int]:
    """Start a long stream through the router and steady traffic beside it, find
    the replica running the stream, apply ``fault`` to that replica's processes;
    the stream's outcome and the replica's index. Only requests in flight to the
    faulted replica may fail, each with a 503 replica_down; none is lost elsewhere."""
    router = fleet["router"]
    outcome: dict = {}
    thread = threading.Thread(target=long_stream, args=(router, outcome))
    thread.start()
    wait_until(lambda: "first" in outcome, 60, "the stream never started")
    running = [i for i, r in enumerate(fleet["replicas"])
               if httpx.get(f"{r}/v1/kv_pool", headers=ALICE).json()["counters"]["num_running"] > 0]
    assert len(running) == 1
    victim = running[0]
    failed_before = failed_counts(router)
    answers: list[httpx.Response] = []
    stop_traffic = threading.Event()
    traffic = threading.Thread(target=steady_traffic, args=(router, answers, stop_traffic))
    traffic.start()
    server = psutil.Process(fleet["children"][victim].pid)
    faulted_at = time.monotonic()
    fault([server, *server.children(recursive=True)])
    thread.join(timeout=60)
    assert "ended" in outcome and outcome["ended"] - faulted_at < 10, "the stream outlived its replica"
    assert json.loads(outcome["last"])["error"]["code"] == "replica_down"
    wait_until(lambda: replicas_up(router) == want_replica_up, 30, "the router never marked the replica down")
    time.sleep(1)  # traffic keeps flowing with one replica
    stop_traffic.set()
    traffic.join(timeout=60)
    failed_after = failed_counts(router)
    survivor = str(1 - victim)
    assert failed_after.get(survivor, 0) == failed_before.get(survivor, 0), "a request on the other replica failed"
    refused = [a for a in answers if a.status_code != 200]
    assert all(a.status_code == 503 and a.json()["error"]["code"] == "replica_down" for a in refused)
    assert len(answers) - len(refused) >= 3
    # Everything now goes to the other replica, and completes.
    for question in range(4):
        chat(router, SYSTEMS[question % 2], f"After the fault {question}?", ALICE)
    return outcome, victim


def test_a_hung_replica_fails_its_requests_and_rejoins(fleet):
    def hang(processes):
        for proc in processes:
            proc.send_signal(signal.SIGSTOP)

    _, victim = stream_then_fault(fleet, hang)
    server = psutil.Process(fleet["children"][victim].pid)
    for proc in [server, *server.children(recursive=True)]:
        proc.send_signal(signal.SIGCONT)
    wait_until(lambda: replicas_up(fleet["router"]) == 2, 60, "the replica never rejoined")
    for replica in fleet["replicas"]:
        assert_server_pool_free(replica, ALICE)


def test_a_killed_replica_fails_only_its_requests_and_a_restarted_one_rejoins(fleet):
    def kill(processes):
        for proc in processes:
            proc.kill()

    _, victim = stream_then_fault(fleet, kill)
    fleet["children"][victim] = fleet["stack"].enter_context(process(fleet["commands"][victim], "restarted-"))
    wait_until(lambda: replicas_up(fleet["router"]) == 2, 180, "the restarted replica never rejoined")
    # The rejoined replica takes new prefixes again (the least-loaded rule spreads them).
    before = routed(fleet["router"])
    for n in range(4):
        chat(fleet["router"], f"A brand new system prompt {n}. " * 12, "Hello?", ALICE)
    after = routed(fleet["router"])
    assert any(key[0] == str(victim) and value > before.get(key, 0) for key, value in after.items()), after
    for replica in fleet["replicas"]:
        assert_server_pool_free(replica, ALICE)


def test_a_router_that_renders_prompts_differently_takes_no_replica(fleet, tiny_llama):
    """Another chat template means other prompt tokens, so other block hashes: the
    replica's /server_info fingerprint differs and the router refuses it."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.cli", "router", "--model", tiny_llama, "--chat-template",
               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
               "--host", "127.0.0.1", "--port", str(port), "--replica", fleet["replicas"][0],
               "--health-interval", "0.25"]
    with process(command, "mismatched-router-"):
        router = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{router}/health").status_code == 503, 60, "the router never answered")
        time.sleep(2)  # several polls of a healthy replica
        answer = httpx.get(f"{router}/health")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"
        refused = httpx.post(f"{router}/v1/completions", json={"model": "m", "prompt": "hi"}, headers=ALICE)
        assert refused.status_code == 503


def in_flight(router: str) -> float:
    prefix = "pagedllm:router_requests_in_flight{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{router}/metrics").text.splitlines()
               if line.startswith(prefix))


def test_a_client_that_leaves_mid_stream_frees_the_replica(fleet):
    router = fleet["router"]
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, headers=ALICE, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    # The router closed its upstream stream, so the replica aborted the request and freed its blocks.
    wait_until(lambda: in_flight(router) == 0, 30, "the router still counts the request in flight")
    for replica in fleet["replicas"]:
        assert_server_pool_free(replica, ALICE)

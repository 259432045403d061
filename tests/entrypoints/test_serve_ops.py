"""Operating the server: `pagedllm serve MODEL`, served names, CORS, /version,
/health, API keys, TLS and the metric names, on a tiny model in-process (the
app `pagedllm serve` builds, driven by Starlette's TestClient or a uvicorn
server in a thread)."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import pagedllm
from pagedllm.bench.server_process import free_port, running_server
from pagedllm.bench.soak import metric_value
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.openai.common.state import tenant_of_key
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import uvicorn_thread

# vLLM v1's Prometheus metrics (vllm/v1/metrics/loggers.py, PrometheusStatLogger, 2025 releases 0.10-0.11),
# leaving out what does not apply here: LoRA (vllm:lora_requests_info), speculative decoding
# (vllm:spec_decode_*), KV connectors (vllm:external_prefix_cache_*), multi-modal caches (vllm:mm_cache_*)
# and the hidden deprecated gpu_* aliases. Counters are listed without their _total suffix.
VLLM_V1_METRICS = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:cache_config_info",
}
# Ours beyond vLLM v1: swapping (vLLM v0's gauge name) and the pool in blocks.
OUR_METRICS = {"num_requests_swapped", "kv_cache_free_blocks", "kv_cache_used_blocks", "kv_cache_cached_blocks",
               "kv_cache_total_blocks"}


@contextlib.contextmanager
def ready(app) -> Iterator[TestClient]:
    """A client of ``app`` once its model has loaded (serve loads it after the server starts)."""
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(client.get("/health").json())
            time.sleep(0.05)
        yield client


def complete(client: TestClient, headers: dict | None = None, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, **body},
                       headers=headers or {})


def test_positional_model_and_vllm_defaults(serve, tiny_llama, capsys):
    app, options, _ = serve()
    assert (options["host"], options["port"], options["log_level"]) == ("0.0.0.0", 8000, "info")
    assert options["ssl_keyfile"] is options["ssl_certfile"] is options["ssl_ca_certs"] is None
    with ready(app) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == tiny_llama
    with pytest.raises(SystemExit) as exc:
        main(["serve", tiny_llama, "--model", "/elsewhere"])
    assert exc.value.code == 2 and "give it once" in capsys.readouterr().err


def test_served_model_names_cors_and_version(serve):
    app, _, _ = serve("--served-model-name", "tiny", "alias", "--allowed-origins", "https://ok.example")
    with ready(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "alias"]
        # As vLLM: a response names the model the request asked for, the first name otherwise.
        answer = complete(client, model="alias")
        assert answer.status_code == 200 and answer.json()["model"] == "alias"
        assert complete(client).json()["model"] == "tiny"
        missing = complete(client, model="other")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert client.get("/version").json() == {"version": pagedllm.__version__}
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = client.options("/v1/completions", headers={"Origin": "https://ok.example", **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://ok.example"
        refused = client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in refused.headers


def test_no_cors_headers_without_allowed_origins(serve):
    app, _, _ = serve()
    with ready(app) as client:
        answer = client.get("/version", headers={"Origin": "https://any.example"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_api_key_from_the_environment_and_repeated_flags(serve, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "sekret-key")
    app, _, _ = serve()
    with ready(app) as client:
        assert complete(client, {"Authorization": "Bearer sekret-key"}).status_code == 200
        for wrong in ("sekret-kez", "sekret", "sekret-key-and-more", ""):
            refused = complete(client, {"Authorization": f"Bearer {wrong}"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert complete(client).status_code == 401
        assert client.get("/health").status_code == 200  # probes need no key
    app, _, _ = serve("--api-key", "one", "--api-key", "two")  # the flag wins over the environment
    with ready(app) as client:
        assert [complete(client, {"Authorization": f"Bearer {key}"}).status_code
                for key in ("one", "two", "sekret-key")] == [200, 200, 401]


def test_key_comparison_checks_every_key():
    keys = {"alpha-key": "alpha", "beta-key": "beta", "plain": None}
    assert tenant_of_key(keys, "beta-key") == (True, "beta")
    assert tenant_of_key(keys, "plain") == (True, None)
    assert tenant_of_key(keys, "beta-ke")[0] is False
    assert tenant_of_key(keys, None)[0] is False
    assert tenant_of_key({}, "")[0] is False


def test_health_is_503_before_start_and_after_the_engine_loop_died(serve, monkeypatch):
    app, _, made = serve()
    starting = TestClient(app)  # not entered: the lifespan (which loads the model) has not run
    not_ready = starting.get("/health")
    assert not_ready.status_code == 503 and not_ready.json()["error"]["code"] == "engine_not_ready"
    with ready(app) as client:
        engine = made[-1].llm_engine

        def failing_step(*_args, **_kwargs):
            raise RuntimeError("injected device failure")

        monkeypatch.setattr(engine.runner, "execute", failing_step)
        started = time.monotonic()
        failed = complete(client)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
        assert client.get("/health").status_code == 503
        again = complete(client)
        assert again.status_code == 503 and "restart the server" in again.json()["error"]["message"]
        assert time.monotonic() - started < 10
        assert not engine.has_unfinished_requests()


def test_health_is_503_while_the_model_loads_and_after_a_failed_load(tiny_llama):
    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import ServerState, build_app

    release = threading.Event()
    made = []

    def slow_load():
        release.wait(timeout=60)
        made.append(LLM(tiny_llama, num_kv_blocks=32))
        return made[-1].llm_engine

    state = ServerState(served_model_name="tiny", load_engine=slow_load)
    with TestClient(build_app(state)) as client:
        for path in ("/health", "/v1/models", "/metrics"):
            loading = client.get(path)
            assert loading.status_code == 503 and "still loading" in loading.json()["error"]["message"]
        assert complete(client).status_code == 503
        assert client.get("/version").status_code == 200
        release.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert complete(client).status_code == 200
    assert_pool_free(made[0])

    def failing_load():
        raise FileNotFoundError("no such checkpoint")

    with TestClient(build_app(ServerState(served_model_name="tiny", load_engine=failing_load))) as client:
        deadline = time.monotonic() + 30
        while "failed" not in client.get("/health").json()["error"]["message"] and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = client.get("/health")
        assert failed.status_code == 503 and "no such checkpoint" in failed.json()["error"]["message"]


def test_tls_flags_serve_https(serve, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    app, options, _ = serve("--host", "127.0.0.1", "--port", str(port), "--ssl-keyfile", str(key),
                            "--ssl-certfile", str(cert), "--uvicorn-log-level", "warning")
    trusted = ssl.create_default_context(cafile=str(cert))
    with uvicorn_thread(app, options):  # exactly what uvicorn.run would have got
        deadline = time.time() + 30
        while httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted, timeout=5).status_code != 200:
            assert time.time() < deadline, "the model did not load"  # serve loads it once listening
            time.sleep(0.05)
        answer = httpx.post(f"https://127.0.0.1:{port}/v1/completions", verify=trusted, timeout=30,
                            json={"prompt": "Hello", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):  # a client that does not trust the certificate is refused
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.HTTPError):  # and plain http is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.parametrize("namespace", ["pagedllm", "vllm"])
def test_metric_names_are_vllms_under_either_namespace(serve, namespace):
    app, _, _ = serve("--metrics-namespace", namespace, "--served-model-name", "tiny")
    with ready(app) as client:
        idle = client.get("/metrics").text  # the pool's gauges are set before any request
        assert metric_value(idle, f"{namespace}:kv_cache_total_blocks") == 64
        assert metric_value(idle, f"{namespace}:kv_cache_free_blocks") == 64
        assert complete(client).status_code == 200
        text = client.get("/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    expected = {name.replace("vllm:", f"{namespace}:") for name in VLLM_V1_METRICS}
    assert names == expected | {f"{namespace}:{name}" for name in OUR_METRICS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # every engine metric names the served model
            assert sample.labels.get("model_name") == "tiny" or family.name == f"{namespace}:cache_config_info"
    assert metric_value(text, f"{namespace}:request_success_total", finished_reason="length") == 1
    assert metric_value(text, f"{namespace}:generation_tokens_total", model_name="tiny") == 3
    assert metric_value(text, f"{namespace}:kv_cache_used_blocks") == 0


@pytest.mark.slow
def test_live_server_counts_tokens_while_a_stream_runs(tiny_llama):
    """A real `pagedllm serve MODEL` process: /metrics advances during a long stream, not only at its end."""
    args = [tiny_llama, "--num-kv-blocks", "64", "--metrics-namespace", "vllm", "--served-model-name", "tiny"]
    with running_server(args, start_timeout_s=180) as (base, _pid):
        def metric(name: str) -> float:
            return metric_value(httpx.get(f"{base}/metrics").text, name)

        tokens = 1000  # long enough to be still running when /metrics is read, even on a fast machine
        body = {"prompt": "Hello", "max_tokens": tokens, "min_tokens": tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            for _ in range(8):
                next(line for line in lines if line.startswith("data: "))
            text = httpx.get(f"{base}/metrics").text  # one snapshot: both values from the same moment
            assert 8 <= metric_value(text, "vllm:generation_tokens_total") < tokens
            assert metric_value(text, "vllm:num_requests_running") == 1
            assert [line for line in lines if line][-1] == "data: [DONE]"
        deadline = time.time() + 30
        while metric("vllm:num_requests_running") or metric("vllm:kv_cache_used_blocks"):
            assert time.time() < deadline, "the request still holds blocks"
            time.sleep(0.1)
        assert metric("vllm:generation_tokens_total") == tokens
        assert metric("vllm:inter_token_latency_seconds_count") == tokens - 1
        assert metric("vllm:time_to_first_token_seconds_count") == 1


def test_serve_takes_the_tier_and_event_flags(serve, tmp_path):
    events = '{"enable_kv_cache_events": true, "publisher": "null"}'
    app, _, made = serve("--kv-offload-host-bytes", str(1 << 20), "--kv-offload-dir", str(tmp_path),
                         "--kv-offload-disk-bytes", str(1 << 30), "--kv-events-config", events,
                         "--num-kv-blocks", "12", "--max-num-seqs", "2")
    with ready(app) as client:
        prompts = [" ".join(f"word{i}-{j}" for j in range(15)) for i in range(4)]
        for _ in range(2):  # the second round finds the first round's prefixes below the pool
            for prompt in prompts:
                assert complete(client, prompt=prompt, max_tokens=4).status_code == 200
        tiers = client.get("/v1/kv_pool").json()["tiers"]
        text = client.get("/metrics").text
    assert tiers["host"]["hits"] > 0 and tiers["disk"]["enabled"]
    assert metric_value(text, "pagedllm:kv_tier_hits_total", medium="CPU") == tiers["host"]["hits"]
    assert metric_value(text, "pagedllm:external_prefix_cache_hits_total") == tiers["host"]["hits"] * 16
    engine = made[-1].llm_engine
    assert engine.kv_tiers.runner.disk.budget_bytes == 1 << 30 and engine.kv_channels.publisher is not None

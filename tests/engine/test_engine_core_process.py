"""The engine core in its own process: the same outputs as in-process, the same
refusals, no block left behind, and a dead core is noticed, not waited on."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time

import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.core_messages import AddRequest, RequestsDropped, input_codec, output_codec
from pagedllm.engine.core_process import EngineCore
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputError
from tests.conftest import assert_pool_free

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "def fibonacci(n):",
           "In a hole in the ground", [5, 17, 99, 1024, 7]]


@pytest.fixture(scope="module")
def in_process(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, seed=3)
    yield llm
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def core_llm(tiny_llama):
    llm = LLM(tiny_llama, engine_process=True, num_kv_blocks=64, seed=3)
    yield llm
    assert_pool_free(llm)
    llm.shutdown()


def test_a_schema_with_an_integer_past_64_bits_crosses_the_wire():
    """msgpack carries no such integer: the schema travels as its JSON text (schemathesis found a 500)."""
    schema = {"type": "object", "x-big": 10**30}
    encoder, decoder = input_codec()
    message = AddRequest("r", [5], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    decoded = decoder.decode(encoder.encode(message))
    assert decoded.params.structured_outputs.json == '{"type": "object", "x-big": 1000000000000000000000000000000}'


def _comparable(output):
    """(everything of an output but its wall-clock times and log-probabilities, the
    log-probabilities): two processes' matmuls may round the last bits differently,
    so those are compared to 1e-5; tokens and text may not differ."""
    exact, floats = [], []

    def split(position):
        if position is None:
            return None
        floats.extend(p.logprob for p in position.values())
        return {t: (p.rank, p.decoded_token) for t, p in position.items()}

    for c in output.outputs:
        floats.append(c.cumulative_logprob)
        exact.append((c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                      None if c.logprobs is None else [split(p) for p in c.logprobs]))
    prompt_logprobs = None if output.prompt_logprobs is None else [split(p) for p in output.prompt_logprobs]
    return (output.request_id, output.prompt, output.prompt_token_ids, prompt_logprobs, exact, output.finished,
            output.num_cached_tokens, output.metrics.num_generation_tokens, output.metrics.num_preemptions), floats


def assert_same_outputs(got, expected) -> None:
    got, expected = [_comparable(o) for o in got], [_comparable(o) for o in expected]
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, got_floats), (_, expected_floats) in zip(got, expected):
        assert got_floats == pytest.approx(expected_floats, abs=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, n=3, seed=11),
    SamplingParams(temperature=1.0, max_tokens=12, best_of=3, n=2, seed=5),
    SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "\n"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}")),
], ids=["greedy", "logprobs", "n3-seeded", "best_of", "stop-strings", "regex"])
def test_outputs_equal_the_in_process_engines(in_process, core_llm, params):
    expected = in_process.generate(PROMPTS, params, use_tqdm=False)
    got = core_llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same_outputs(got, expected)
    assert core_llm.stats()["num_free_blocks"] == core_llm.stats()["num_blocks"]


def test_beam_search_and_chat_equal_the_in_process_engines(in_process, core_llm):
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    for got, expected in zip(core_llm.beam_search(PROMPTS[:3], beams), in_process.beam_search(PROMPTS[:3], beams)):
        assert [(s.tokens, s.text) for s in got.sequences] == [(s.tokens, s.text) for s in expected.sequences]
        assert [s.score for s in got.sequences] == pytest.approx([s.score for s in expected.sequences], abs=1e-5)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    chat = [{"role": "user", "content": "Name a colour."}]
    assert_same_outputs(core_llm.chat(chat, params, use_tqdm=False), in_process.chat(chat, params, use_tqdm=False))


def test_refusals_are_the_in_process_engines(in_process, core_llm):
    bad = [("", SamplingParams()), ([10**7], SamplingParams()), ("hi", SamplingParams(logprobs=50)),
           ("hi", SamplingParams(max_tokens=5000))]
    for prompt, params in bad:
        with pytest.raises(ValueError) as local:
            in_process.generate(prompt, params, use_tqdm=False)
        with pytest.raises(ValueError) as remote:
            core_llm.generate(prompt, params, use_tqdm=False)
        assert str(remote.value) == str(local.value)
    with pytest.raises(StructuredOutputError) as refused:
        core_llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objectx"})),
                          use_tqdm=False)
    assert refused.value.kind == "json"
    # A refusal midway withdraws the prompts queued before it: nothing runs, nothing is held.
    with pytest.raises(ValueError):
        core_llm.generate(["fine", "also fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert core_llm.stats()["num_free_blocks"] == core_llm.stats()["num_blocks"]
    assert core_llm.llm_engine.call("num_unfinished_requests") == 0


def test_counters_and_metrics_come_from_the_core(core_llm):
    core_llm.reset_prefix_cache()
    core_llm.generate("A shared prefix of several words, long enough to fill a block or two of KV cache.",
                      SamplingParams(max_tokens=2), use_tqdm=False)
    assert core_llm.stats()["num_cached_blocks"] > 0
    snapshot = core_llm.kv_pool_snapshot()
    assert snapshot["num_blocks"] == 64 and any(b["state"] == "cached" for b in snapshot["blocks"])
    names = {m.name for m in core_llm.get_metrics()}
    assert "pagedllm:generation_tokens" in names and "pagedllm:kv_cache_usage_perc" in names
    assert core_llm.weight_bytes() > 0 and set(core_llm.step_timings()) >= {"forward", "sampling"}
    assert core_llm.llm_engine.capacity_line().startswith("KV cache: 64 blocks x 16 tokens")


def test_a_killed_core_fails_requests_at_once(tiny_llama):
    """Liveness is checked every 0.25 s; the bound leaves room for a loaded CI machine."""
    llm = LLM(tiny_llama, engine_process=True, num_kv_blocks=64)
    try:
        os.kill(llm.llm_engine.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - started < 1.5
    finally:
        llm.shutdown()


def test_a_core_that_cannot_load_says_so(tmp_path):
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(tmp_path / "missing"), engine_process=True, no_such_option=1)  # refused here: no core started
    with pytest.raises(RuntimeError, match="exited with status 1 while loading"):
        LLM(str(tmp_path / "missing"), engine_process=True)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="exited with status 1 while loading"):
        LLM(str(tmp_path / "broken"), engine_process=True)


def test_a_client_that_stops_reading_holds_up_no_one(tiny_llama):
    """A raw API client adds a long request and never reads its outputs: the core's
    sends never block, so another client is served meanwhile (the same outputs as
    in-process), and once the silent client is gone its request is aborted."""
    llm = LLM(tiny_llama, engine_process=True, num_kv_blocks=256, seed=3)
    folder = private_folder_of(llm)
    context = zmq.Context()
    silent = context.socket(zmq.DEALER)
    silent.setsockopt(zmq.LINGER, 0)
    try:
        silent.connect(llm.llm_engine.core.launch.address)
        encode = input_codec()[0].encode
        silent.send(encode(AddRequest("silent", [5, 17, 99], SamplingParams(max_tokens=4000, ignore_eos=True))))
        params = SamplingParams(max_tokens=24, temperature=0)
        reference = LLM(tiny_llama, num_kv_blocks=256, seed=3)
        expected = reference.generate(PROMPTS, params, use_tqdm=False)
        assert_pool_free(reference)
        assert_same_outputs(llm.generate(PROMPTS, params, use_tqdm=False), expected)
        assert llm.llm_engine.call("num_unfinished_requests") == 1  # the silent one still runs, unread
        silent.close()
        deadline = time.monotonic() + 30
        while llm.llm_engine.call("num_unfinished_requests"):
            assert time.monotonic() < deadline, "the gone client's request was never aborted"
            time.sleep(0.1)
        aborted = [m for m in llm.get_metrics() if m.name == "pagedllm:request_success"
                   and m.labels.get("finished_reason") == "abort"]
        assert sum(m.value for m in aborted) == 1
        assert_pool_free(llm)
    finally:
        silent.close()
        context.term()
        llm.shutdown()
    assert not os.path.exists(folder)  # the endpoint's private folder went with the core


def private_folder_of(llm) -> str:
    """The folder of the core's socket, checked to be this user's alone."""
    folder = os.path.dirname(llm.llm_engine.core.launch.address.removeprefix("ipc://"))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    return folder


def test_requests_dropped_while_a_client_was_full_are_reported_once_it_reads(tiny_llama):
    """The core's queue to a client that stops reading fills up (here after a few messages):
    its request is aborted, and once the client reads again it is told which requests were
    dropped and why, so no stream of a resumed API server waits forever."""
    llm = LLM(tiny_llama, num_kv_blocks=256)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 2)
    router.bind("inproc://core")
    core = EngineCore(llm.llm_engine, router)
    loop = threading.Thread(target=core.run, args=(None,))
    loop.start()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVHWM, 2)
    client.setsockopt(zmq.LINGER, 0)
    client.connect("inproc://core")
    decode = output_codec()[1].decode
    try:
        client.send(input_codec()[0].encode(AddRequest("slow", [5, 17, 99],
                                                       SamplingParams(max_tokens=2000, ignore_eos=True))))
        deadline = time.monotonic() + 30
        while not core._dropped:
            assert time.monotonic() < deadline, "the full client's request was never dropped"
            time.sleep(0.05)
        messages = []
        while not any(isinstance(m, RequestsDropped) for m in messages):
            assert time.monotonic() < deadline, f"no RequestsDropped after {messages}"
            if client.poll(100):
                messages.append(decode(client.recv()))
        dropped = next(m for m in messages if isinstance(m, RequestsDropped))
        assert dropped.request_ids == ["slow"] and "did not read" in dropped.reason
        assert not isinstance(messages[0], RequestsDropped)  # what was queued came first
    finally:
        core.stopping = True
        loop.join()
        client.close()
        router.close()
        context.term()
    assert_pool_free(llm)

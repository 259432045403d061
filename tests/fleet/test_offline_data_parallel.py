"""``LLM(data_parallel_size=N)``: N engine-core replicas give a single engine's
greedy outputs, prompts sharing a prefix go to the same replica, the prompt tokens
are balanced, a refusal withdraws everything, and no replica keeps a block."""

from __future__ import annotations

import os

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config.engine import EngineConfig
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.fleet.offline import merge_stats, replica_options
from tests.conftest import assert_pool_free

# Four prefixes of several blocks (16 tokens each), four prompts each, interleaved.
PREFIXES = [
    "You are a careful assistant who answers questions about the history of European railways in detail. ",
    "The following is a transcript of a long meeting about the quarterly budget of a small bakery in town. ",
    "def parse_arguments(argv):\n    parser = argparse.ArgumentParser(description='a tool that copies files')\n",
    "Once upon a time, in a kingdom far beyond the mountains, there lived an old clockmaker and his cat. ",
]
SUFFIXES = ["Question one?", "Tell me more.", "What happened next", "Summarise it."]
PROMPTS = [prefix + suffix for suffix in SUFFIXES for prefix in PREFIXES]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def single(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128, seed=3)
    yield llm
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def fleet(tiny_llama):
    llm = LLM(tiny_llama, data_parallel_size=2, num_kv_blocks=128, seed=3)
    yield llm
    assert_pool_free(llm)
    llm.shutdown()


def _texts(outputs):
    return [(o.prompt, o.prompt_token_ids, [(c.token_ids, c.text, c.finish_reason) for c in o.outputs])
            for o in outputs]


def test_greedy_outputs_equal_one_engines_and_shared_prefixes_share_a_replica(single, fleet):
    fleet.reset_prefix_cache()
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = fleet.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _texts(got) == _texts(expected)
    ids = [o.request_id for o in got]
    assert len(set(ids)) == len(ids)

    assignment = fleet.llm_engine.last_assignment
    by_prefix = {prefix: {assignment[i] for i, p in enumerate(PROMPTS) if p.startswith(prefix)} for prefix in PREFIXES}
    assert all(len(replicas) == 1 for replicas in by_prefix.values()), by_prefix
    assert sorted(assignment.count(r) for r in (0, 1)) == [8, 8]  # two prefixes each: balanced
    # Each replica computed its prefixes once and found them cached for the other prompts.
    for replica in fleet.llm_engine.replicas:
        stats = replica.stats()
        assert stats["prefix_cache_hits"] >= 3 * 2 * stats["block_size"], stats
        assert stats["num_free_blocks"] == stats["num_blocks"]
    merged = fleet.stats()
    assert merged["num_blocks"] == 256 and merged["num_free_blocks"] == 256 and merged["block_size"] == 16
    assert merged["data_parallel_size"] == 2


def test_a_later_call_goes_where_its_prefix_went_before(fleet):
    fleet.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    first = list(fleet.llm_engine.last_assignment)
    fleet.generate([PROMPTS[3] + " Again.", PROMPTS[0] + " Again."], GREEDY, use_tqdm=False)
    assert fleet.llm_engine.last_assignment == [first[3], first[0]]


def test_token_ids_chat_and_beam_search_equal_one_engines(single, fleet):
    prompts = [[5, 17, 99, 1024, 7] * 8, {"prompt_token_ids": [3, 4, 5, 6] * 9}, "Hello, my name is"]
    assert _texts(fleet.generate(prompts, GREEDY, use_tqdm=False)) == _texts(single.generate(prompts, GREEDY,
                                                                                          use_tqdm=False))
    chat = [[{"role": "user", "content": f"Name a colour, {i}."}] for i in range(3)]
    assert _texts(fleet.chat(chat, GREEDY, use_tqdm=False)) == _texts(single.chat(chat, GREEDY, use_tqdm=False))
    beams = BeamSearchParams(beam_width=2, max_tokens=6)
    got, expected = fleet.beam_search(PROMPTS[:3], beams), single.beam_search(PROMPTS[:3], beams)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in expected]


def test_a_bad_prompt_raises_and_nothing_leaks(fleet):
    for bad in (["fine", "also fine", "", "more"], PROMPTS[:6] + [[10**7]]):
        with pytest.raises(ValueError):
            fleet.generate(bad, SamplingParams(max_tokens=4), use_tqdm=False)
        stats = fleet.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert [replica.call("num_unfinished_requests") for replica in fleet.llm_engine.replicas] == [0, 0]
        assert not fleet.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy"):  # refused by the replica, after others were queued
        fleet.generate(PROMPTS[:4], GREEDY, priority=[0, 0, 0, 1], use_tqdm=False)
    assert fleet.stats()["num_free_blocks"] == fleet.stats()["num_blocks"]
    with pytest.raises(ValueError, match="SamplingParams"):
        fleet.generate(PROMPTS[:2], [GREEDY], use_tqdm=False)
    assert fleet.generate("still works", GREEDY, use_tqdm=False)[0].finished


def test_the_other_methods_aggregate(fleet):
    fleet.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    snapshot = fleet.kv_pool_snapshot()
    assert snapshot["data_parallel_size"] == 2 and [s["num_blocks"] for s in snapshot["replicas"]] == [128, 128]
    engines = {m.labels.get("engine") for m in fleet.get_metrics() if m.name == "pagedllm:generation_tokens"}
    assert engines == {"0", "1"}
    assert fleet.weight_bytes() == 2 * fleet.llm_engine.replicas[0].weight_bytes()
    assert set(fleet.step_timings()) >= {"forward", "sampling"}
    fleet.reset_step_timings()
    fleet.reset_peak_blocks_in_use()
    assert fleet.reset_prefix_cache() > 0 and fleet.stats()["num_cached_blocks"] == 0
    assert fleet.llm_engine.step() == []  # nothing queued


def test_the_fleet_is_an_engine_client_routing_each_request(single, fleet):
    engine = fleet.llm_engine
    for prompt in PROMPTS[:3]:
        engine.add_request(engine.next_request_id(), prompt, GREEDY)
    engine.add_request(engine.next_request_id(), PROMPTS[3], BeamSearchParams(beam_width=2, max_tokens=6))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
    got = sorted(finished.values(), key=lambda output: int(output.request_id))
    assert _texts(got[:3]) == _texts(single.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
    beams = single.beam_search(PROMPTS[3:4], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [got[3].prompt_token_ids + c.token_ids for c in got[3].outputs] == [s.tokens for s in beams[0].sequences]
    assert len(engine.last_assignment) == 4


@pytest.mark.parametrize("size", [0, -1, True, 1.0, "2"])
def test_a_bad_data_parallel_size_is_refused(size):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(data_parallel_size=size)


def test_num_threads_is_validated_and_shared_among_replicas():
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            EngineConfig(num_threads=bad)
    assert EngineConfig(num_threads=3).num_threads == 3
    cores = os.cpu_count() or 1
    assert replica_options({}, 2)["num_threads"] == max(1, cores // 2)
    assert replica_options({"tensor_parallel_size": 2}, 2)["num_threads"] == max(1, cores // 4)
    assert replica_options({"num_threads": 5}, 2)["num_threads"] == 5


def test_merged_stats_sum_counts_and_keep_constants():
    one = {"num_blocks": 10, "block_size": 16, "kv_cache_dtype": "auto", "num_steps": 4, "num_scheduled_sequences": 8,
           "mean_running_per_step": 2.0, "peak_running_per_step": 3, "prefix_cache_hits": 5}
    two = {**one, "num_steps": 0, "num_scheduled_sequences": 0, "mean_running_per_step": 0.0,
           "peak_running_per_step": 0, "prefix_cache_hits": 1}
    merged = merge_stats([one, two])
    assert merged == {**one, "num_blocks": 20, "prefix_cache_hits": 6, "mean_running_per_step": 2.0,
                      "data_parallel_size": 2}

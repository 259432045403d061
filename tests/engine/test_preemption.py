"""Running out of blocks: preemption by recompute and swap, chunked prefill, priorities.
Every loop here is bounded, and every test ends with an all-free pool."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free

MAX_STEPS = 5000


def workload(num: int = 32, seed: int = 0):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(300, 4000) for _ in range(rng.randint(20, 100))]} for _ in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(64, 128), ignore_eos=True) for _ in range(num)]
    return prompts, params


def drive(llm: LLM, prompts, params, priorities=None) -> dict[str, object]:
    """Add everything, then step with a bound; returns final outputs by request id."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p, priority=priorities[i] if priorities else 0)
    finished = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests(), "did not finish within the step bound"
    return finished


def tokens_of(finished) -> list[list[int]]:
    return [finished[str(i)].outputs[0].token_ids for i in range(len(finished))]


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_a_40_block_pool_serves_32_requests_exactly(tiny_llama, mode):
    prompts, params = workload()
    reference = tokens_of(drive(LLM(tiny_llama, num_kv_blocks=1024, enable_prefix_caching=False), prompts, params))
    small = LLM(tiny_llama, num_kv_blocks=40, preemption_mode=mode, swap_space=0.01, debug_invariants=True,
                enable_prefix_caching=False)
    finished = drive(small, prompts, params)
    assert tokens_of(finished) == reference
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in finished.values()) == stats["num_preemptions"]
    if mode == "swap":
        assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"]
    else:
        assert stats["num_recomputed_tokens"] > 0 and stats["swap_out_blocks"] == 0
    assert_pool_free(small)


def test_swap_round_trip_restores_the_exact_bytes(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=24, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    pool = llm.llm_engine.runner.host_store
    saved: dict[int, list[torch.Tensor]] = {}
    checked = []
    real_out, real_in = pool.swap_out, pool.swap_in

    def swap_out(caches, pairs):
        for device_block, host_block in pairs:
            saved[host_block] = [t[device_block].clone() for layer in caches for t in layer.tensors()]
        real_out(caches, pairs)

    def swap_in(caches, pairs):
        real_in(caches, pairs)
        for host_block, device_block in pairs:
            restored = [t[device_block] for layer in caches for t in layer.tensors()]
            assert all(torch.equal(a, b) for a, b in zip(restored, saved.pop(host_block)))
            checked.append(device_block)

    pool.swap_out, pool.swap_in = swap_out, swap_in
    prompts, params = workload(8, seed=3)
    drive(llm, prompts, params)
    assert checked and not saved
    assert_pool_free(llm)


def test_chunked_prefill_matches_and_lets_decodes_advance(tiny_llama):
    long_prompt = {"prompt_token_ids": [(13 * j) % 3000 + 300 for j in range(1000)]}
    params = SamplingParams(temperature=0.0, max_tokens=16)
    whole = LLM(tiny_llama, num_kv_blocks=256, max_num_batched_tokens=2048, enable_prefix_caching=False)
    expected = whole.generate(long_prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    chunked = LLM(tiny_llama, num_kv_blocks=256, max_num_batched_tokens=128, debug_invariants=True,
                  enable_prefix_caching=False)
    engine = chunked.llm_engine
    engine.add_request("short-a", [400, 401, 402], SamplingParams(temperature=0.0, max_tokens=40))
    engine.add_request("short-b", [500, 501], SamplingParams(temperature=0.0, max_tokens=40))
    engine.step()
    engine.add_request("long", long_prompt, params)
    prefill_steps = decodes_during_prefill = 0
    final = None
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        long_request = engine.scheduler.requests.get("long")
        prefilling = long_request is not None and long_request.num_output_tokens == 0
        outputs = engine.step()
        if prefilling:
            prefill_steps += 1
            decodes_during_prefill += sum(o.request_id.startswith("short") for o in outputs)
        final = next((o for o in outputs if o.request_id == "long" and o.finished), final)
    assert prefill_steps >= 1000 // 128
    # Both short requests got a token in every step of the long prefill.
    assert decodes_during_prefill == 2 * prefill_steps
    assert final.outputs[0].token_ids == expected
    assert_pool_free(chunked)
    assert_pool_free(whole)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_right_victim_is_preempted(tiny_llama, policy):
    llm = LLM(tiny_llama, num_kv_blocks=14, scheduling_policy=policy, debug_invariants=True,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [300 + 50 * i + j for j in range(30)]} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 3
    # Request 0 arrives first but is the least urgent under the priority policy.
    priorities = [9, 0, 0] if policy == "priority" else None
    finished = drive(llm, prompts, params, priorities)
    preemptions = [finished[str(i)].metrics.num_preemptions for i in range(3)]
    if policy == "priority":
        assert preemptions[0] > 0 and preemptions[1] == preemptions[2] == 0
    else:
        assert preemptions[2] > 0 and preemptions[0] == 0  # the latest arrival is the victim
    assert_pool_free(llm)


def test_seeded_sampling_survives_preemption(tiny_llama):
    prompts, _ = workload(12, seed=5)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=i, ignore_eos=True) for i in range(12)]
    roomy = tokens_of(drive(LLM(tiny_llama, num_kv_blocks=1024), prompts, params))
    tight = LLM(tiny_llama, num_kv_blocks=20, debug_invariants=True)
    assert tokens_of(drive(tight, prompts, params)) == roomy
    assert tight.stats()["num_preemptions"] > 0
    assert_pool_free(tight)


def test_bad_scheduling_options_are_value_errors(tiny_llama):
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(tiny_llama, preemption_mode="hope")
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_llama, scheduling_policy="lottery")
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(tiny_llama, long_prefill_token_threshold=0)
    llm = LLM(tiny_llama, num_kv_blocks=8)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate("hi", SamplingParams(max_tokens=2), priority=[3], use_tqdm=False)
    assert_pool_free(llm)


def test_swapped_requests_pinning_shared_blocks_fall_back_to_recompute(tiny_llama):
    """Swapped requests keep their references to shared blocks (a common
    prefix, a fork's shared tail). With 12 blocks of 8 tokens, n=2 forks and a
    shared 32-token prefix, those pinned blocks once left nothing running and
    nothing able to come back (the engine raised "could not schedule"); now the
    swapped requests fall back to recompute and every request finishes with the
    tokens it gets in a roomy pool."""
    prefix = [(17 * j) % 3000 + 200 for j in range(32)]
    prompts = [{"prompt_token_ids": prefix + [(29 * i + 7 * j) % 3000 + 300 for j in range(10 + 6 * i)]}
               for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=20, ignore_eos=True) for i in range(5)]
    roomy = LLM(tiny_llama, num_kv_blocks=128, block_size=8, debug_invariants=True)
    tight = LLM(tiny_llama, num_kv_blocks=12, block_size=8, preemption_mode="swap", debug_invariants=True)
    for _ in range(2):  # the second round also hits the prefix cache
        expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
        got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    assert tight.stats()["swap_out_blocks"] > 0 and tight.stats()["num_recomputed_tokens"] > 0
    assert_pool_free(roomy)
    assert_pool_free(tight)

"""The contiguous baseline runs the same model: identical outputs, fewer sequences at once."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free


def test_contiguous_layout_gives_identical_greedy_outputs(tiny_llama):
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 3000 + 300 for j in range(10 + 9 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    paged = LLM(tiny_llama, num_kv_blocks=64, max_model_len=128, debug_invariants=True)
    contiguous = LLM(tiny_llama, num_kv_blocks=64, max_model_len=128, kv_layout="contiguous", debug_invariants=True)
    expected = [o.outputs[0].token_ids for o in paged.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in contiguous.generate(prompts, params, use_tqdm=False)] == expected
    # 64 blocks = 8 reservations of 128 tokens; paged held far less for the same requests.
    assert contiguous.stats()["peak_blocks_in_use"] == 6 * 8
    assert paged.stats()["peak_blocks_in_use"] <= sum(-(-(10 + 9 * i + 20) // 16) for i in range(6))
    assert_pool_free(paged)
    assert_pool_free(contiguous)


def test_contiguous_waits_on_external_fragmentation_and_paged_does_not(tiny_llama):
    """Per-request reservations (prompt + max_tokens) in a 10-block pool: a (2 blocks,
    short), b (4, long), c (2, short), d (2, long) fill it in that order. When a and c
    finish, 4 blocks are free but in two holes of 2: e (3 blocks) waits although the
    free total would fit it, external fragmentation. The paged layout admits e at once."""
    # request: (prompt tokens, max_tokens); reservation = ceil((prompt + max_tokens) / 16) blocks
    sizes = {"a": (20, 4), "b": (8, 50), "c": (20, 4), "d": (8, 24), "e": (8, 40)}

    def run(layout: str) -> tuple[int, LLM]:
        llm = LLM(tiny_llama, num_kv_blocks=10, max_model_len=64, kv_layout=layout,
                  contiguous_reservation="request", enable_prefix_caching=False, debug_invariants=True)
        engine = llm.llm_engine
        def add(rid: str) -> None:
            prompt, max_tokens = sizes[rid]
            engine.add_request(rid, [300 + ord(rid)] * prompt,
                               SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens))

        for rid in "abcd":
            add(rid)
        engine.step()
        while "a" in engine.scheduler.requests or "c" in engine.scheduler.requests:
            engine.step()
        add("e")
        waited = 0
        for _ in range(300):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            waited += engine.scheduler.requests.get("e") is not None and engine.scheduler.requests["e"].num_computed_tokens == 0
        return waited, llm

    waited, contiguous = run("contiguous")
    assert waited > 0
    assert contiguous.stats()["external_fragmentation_waits"] > 0
    waited, paged = run("paged")
    assert waited == 0 and paged.stats()["external_fragmentation_waits"] == 0
    assert_pool_free(contiguous)
    assert_pool_free(paged)


def test_contiguous_refuses_forks(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=16, max_model_len=64, kv_layout="contiguous")
    with pytest.raises(ValueError, match="kv_layout='paged'"):
        llm.generate("hi", SamplingParams(n=2), use_tqdm=False)
    assert_pool_free(llm)

"""`LLM.kv_pool_snapshot()`: the pool as data, caught while requests run."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free


def _run_until_running(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    engine = llm.llm_engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    engine.step()  # prefill (and fork)
    engine.step()  # one decode
    return llm.kv_pool_snapshot()


def _finish(llm: LLM) -> None:
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def test_an_n4_request_shows_its_prompt_blocks_with_refcount_4(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=32, debug_invariants=True)
    prompt = [(31 * j) % 3000 + 300 for j in range(40)]  # 2 full blocks + 8 tokens
    snapshot = _run_until_running(llm, {"r": (prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=20))})
    assert snapshot["num_blocks"] == 32 and snapshot["block_size"] == 16 and len(snapshot["blocks"]) == 32
    shared = [b for b in snapshot["blocks"] if b["ref_cnt"] == 4]
    assert len(shared) == 2 and all(b["state"] == "used" and b["hashed"] for b in shared)
    assert all(sorted(b["owners"]) == ["r", "r::1", "r::2", "r::3"] for b in shared)
    # Each sample wrote its own token into the partial third block: 4 private copies.
    private = [b for b in snapshot["blocks"] if b["ref_cnt"] == 1]
    assert len(private) == 4 and sorted(o for b in private for o in b["owners"]) == ["r", "r::1", "r::2", "r::3"]
    counters = snapshot["counters"]
    assert counters["blocks_in_use"] == 6 and counters["usage"] == 6 / 32 and counters["num_running"] == 4
    _finish(llm)
    after = llm.kv_pool_snapshot()
    assert all(b["state"] in ("free", "cached") and b["ref_cnt"] == 0 and not b["owners"] for b in after["blocks"])
    assert sum(b["state"] == "cached" for b in after["blocks"]) >= 2  # the hashed prompt blocks stay cached
    assert_pool_free(llm)


def test_two_requests_with_one_prefix_share_its_blocks(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=32, debug_invariants=True)
    prefix = [(17 * j) % 3000 + 200 for j in range(32)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate({"prompt_token_ids": prefix + [5, 6, 7]}, params, use_tqdm=False)  # caches the prefix
    snapshot = _run_until_running(llm, {"a": (prefix + [900, 901], params), "b": (prefix + [902, 903, 904], params)})
    shared = [b for b in snapshot["blocks"] if b["ref_cnt"] == 2]
    assert len(shared) == 2 and all(sorted(b["owners"]) == ["a", "b"] and b["hashed"] for b in shared)
    assert snapshot["counters"]["prefix_cache_hit_rate"] > 0
    _finish(llm)
    assert_pool_free(llm)


def test_the_contiguous_layout_has_the_same_view(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=32, kv_layout="contiguous", max_model_len=64, debug_invariants=True)
    snapshot = _run_until_running(llm, {"c": ([300 + j for j in range(10)], SamplingParams(max_tokens=8))})
    used = [b for b in snapshot["blocks"] if b["state"] == "used"]
    assert len(used) == 4 and all(b["owners"] == ["c"] and b["ref_cnt"] == 1 for b in used)  # 64-token reservation
    _finish(llm)
    assert_pool_free(llm)

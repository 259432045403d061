"""Multi-LoRA in the engine, on the tiny random Llama, against Hugging Face + PEFT.

Every test runs real PEFT adapters through ``LLM.generate`` and checks greedy tokens
against PEFT's own generation (``tests/lora/adapters.py``), and ends with the pool
all free."""

from __future__ import annotations

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm_dev.differential.prompts import real_text_prompts
from tests.conftest import assert_pool_free
from tests.lora.adapters import make_peft_adapter, peft_greedy

MAX_TOKENS = 12
# Pages of the "all8" adapter on the tiny Llama: 4,096 values of A and of B per layer, 512 per fp32 block.
ALL8_FP32_PAGES = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Two adapters of different shapes: every projection at rank 8, and q/v only at rank 4 with rslora."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": make_peft_adapter(tiny_llama, str(root / "all8"), rank=8, seed=1),
        "qv4": make_peft_adapter(tiny_llama, str(root / "qv4"), rank=4, targets=("q_proj", "v_proj"),
                                 use_rslora=True, seed=2),
    }


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer) -> list[list[int]]:
    return [smollm_tokenizer.encode(text) for text in real_text_prompts(6, seed=44, max_words=60)]


@pytest.fixture(scope="module")
def oracle(tiny_llama, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens per prompt, for the base (None) and each adapter."""
    return {name: peft_greedy(tiny_llama, None if name is None else adapters[name], prompts, MAX_TOKENS)
            for name in (None, *adapters)}


def _requests(adapters: dict[str, str]) -> dict[str | None, LoRARequest | None]:
    return {None: None, **{name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}}


def _tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]


def test_each_adapter_and_a_mixed_batch_equal_peft(tiny_llama, adapters, prompts, oracle):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    requests = _requests(adapters)
    for name, request in requests.items():
        assert _tokens(llm, prompts, request) == oracle[name], name
    # One batch, rows of both adapters and of the base interleaved.
    names = [None, "all8", "qv4", "all8", "qv4", None]
    assert _tokens(llm, prompts, [requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    assert oracle["all8"] != oracle[None] and oracle["qv4"] != oracle[None]
    assert_pool_free(llm)


def test_prefix_cache_never_serves_one_adapters_kv_to_another(tiny_llama, adapters, prompts):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    requests = _requests(adapters)
    long_prompt = prompts[0] * 3  # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(name):
        return llm.generate([long_prompt], params, lora_request=requests[name], use_tqdm=False)[0].num_cached_tokens

    assert cached("all8") == 0
    assert cached(None) == 0 and cached("qv4") == 0  # same tokens, other weights: no hit
    assert cached("all8") >= 16 and cached(None) >= 16  # each one's own blocks are reused
    assert_pool_free(llm)


def test_adapters_wait_for_pages_and_are_evicted_lru(tiny_llama, adapters, prompts, oracle, tmp_path):
    """A pool with room for one large adapter beside a request's blocks, not two: each
    switch of adapter waits for the pages, and the idle adapter's pages are evicted like
    cached prefix blocks when the requests' blocks need them; nothing fails."""
    other = {"all8": adapters["all8"], "all8b": make_peft_adapter(tiny_llama, str(tmp_path / "b"), rank=8, seed=3)}
    requests = _requests(other)
    probe = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    pages = probe.llm_engine.adapter_registry.spec_for(requests["all8"]).num_pages
    most_blocks = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=pages + most_blocks + 2, max_num_seqs=1)
    names = ["all8", "all8b", "all8", "all8b"]
    expected = [oracle["all8"][0], peft_greedy(tiny_llama, other["all8b"], prompts[1:2], MAX_TOKENS)[0],
                oracle["all8"][2], peft_greedy(tiny_llama, other["all8b"], prompts[3:4], MAX_TOKENS)[0]]
    assert _tokens(llm, prompts[:4], [requests[n] for n in names]) == expected
    assert llm.llm_engine.kv_cache_manager.num_adapter_page_ins == 4  # each switch evicted the other adapter
    assert_pool_free(llm)


def test_max_loras_bounds_adapters_per_step(tiny_llama, adapters, prompts, oracle):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, max_loras=1, num_kv_blocks=128)
    requests = _requests(adapters)
    names = ["all8", "qv4", "all8", "qv4"]
    engine = llm.llm_engine
    seen = []
    step = engine.runner.adapters.set_step

    def spy(runs, num_rows):
        seen.append({name for _, _, name in runs if name is not None})
        step(runs, num_rows)

    engine.runner.adapters.set_step = spy
    assert _tokens(llm, prompts[:4], [requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    assert max(len(names_in_step) for names_in_step in seen) == 1
    assert_pool_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_lora_requests_resume_with_their_adapter(tiny_llama, adapters, prompts, oracle, mode):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=16, preemption_mode=mode,
              swap_space=0.01)
    requests = _requests(adapters)
    names = ["all8", "qv4", None, "all8", "qv4", None]
    assert _tokens(llm, prompts, [requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_free(llm)


def test_speculative_decoding_with_adapters_changes_nothing(tiny_llama, adapters, prompts, oracle):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    requests = _requests(adapters)
    names = ["all8", "qv4", None, "all8", "qv4", None]
    assert _tokens(llm, prompts, [requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    assert_pool_free(llm)


def test_core_process_engine_serves_adapters(tiny_llama, adapters, prompts, oracle):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=128, engine_process=True)
    try:
        requests = _requests(adapters)
        names = ["qv4", None, "all8"]
        assert _tokens(llm, prompts[:3], [requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_and_running_work_carries_on(tiny_llama, adapters, prompts, oracle, tmp_path):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=4, num_kv_blocks=128)
    good = LoRARequest("qv4", 1, adapters["qv4"])
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm.generate(prompts[:1], lora_request=LoRARequest("all8", 2, adapters["all8"]), use_tqdm=False)
    with pytest.raises(ValueError, match="missing"):
        llm.generate(prompts[:1], lora_request=LoRARequest("gone", 3, str(tmp_path / "missing")), use_tqdm=False)
    assert _tokens(llm, prompts[:2], good) == oracle["qv4"][:2]
    with pytest.raises(ValueError, match="already loaded"):
        llm.generate(prompts[:1], lora_request=LoRARequest("qv4", 1, adapters["all8"]), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, adapters["qv4"])
    assert_pool_free(llm)


def test_an_engine_without_lora_refuses_an_adapter(tiny_llama, adapters, prompts):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(prompts[:1], lora_request=LoRARequest("qv4", 1, adapters["qv4"]), use_tqdm=False)
    assert_pool_free(llm)


def test_the_prefix_cache_key_holds_the_adapters_content(tiny_llama, adapters, tmp_path):
    """Two adapters under one name (one unloaded, the other loaded from another file) key their
    blocks apart: the key holds a digest of the files, not the name alone."""
    import shutil

    from pagedllm.lora.registry import AdapterRegistry

    copy = shutil.copytree(adapters["qv4"], tmp_path / "copy")
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    registry: AdapterRegistry = llm.llm_engine.adapter_registry
    same = registry.spec_for(LoRARequest("qv4", 1, adapters["qv4"]))
    assert registry.forget("qv4")
    assert registry.spec_for(LoRARequest("qv4", 1, str(copy))).fingerprint == same.fingerprint  # same bytes
    assert registry.forget("qv4")
    other = registry.spec_for(LoRARequest("qv4", 1, adapters["all8"]))
    assert other.fingerprint != same.fingerprint
    assert_pool_free(llm)


def test_two_tensor_parallel_ranks_serve_adapters_as_peft(tiny_llama, adapters, prompts, oracle):
    """Each rank holds its shard of every adapter (A whole and B's rows for q/k/v and
    gate/up, A's columns and B whole for o and down) in its own pool's pages."""
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        requests = _requests(adapters)
        names = ["all8", "qv4", None, "all8"]
        assert _tokens(llm, prompts[:4], [requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
        assert_pool_free(llm)
    finally:
        llm.llm_engine.shutdown()


def test_the_pool_snapshot_shows_adapter_pages(tiny_llama, adapters, prompts):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    request = _requests(adapters)["all8"]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=request, use_tqdm=False)
    snapshot = llm.kv_pool_snapshot()
    pages = [block for block in snapshot["blocks"] if block["adapter"] == "all8"]
    num_pages = llm.llm_engine.adapter_registry.spec_for(request).num_pages
    assert len(pages) == num_pages and {block["state"] for block in pages} == {"cached"}  # idle, evictable
    assert [b["block_id"] for b in pages] == list(range(64 - num_pages, 64))  # one run, at the top
    assert snapshot["adapters"] == [{"name": "all8", "pages": num_pages, "first_block": 64 - num_pages,
                                     "pinned_by": 0}]
    assert_pool_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_pages_of_a_quantized_pool_hold_the_adapter_exactly(tiny_llama, adapters, prompts, kv_cache_dtype):
    """An int8 or fp8 pool's blocks hold an adapter's fp32 values as raw bytes (4x the pages)."""
    from pagedllm.lora.adapter_files import read_adapter

    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype)
    request = _requests(adapters)["all8"]
    llm.generate(prompts[:2], SamplingParams(max_tokens=3), lora_request=request, use_tqdm=False)
    runner = llm.llm_engine.runner.adapters
    first_block, layout = runner.placed["all8"]
    weights = read_adapter(adapters["all8"], llm.llm_engine.model_config, 8)
    base = first_block * runner.page_elems
    for (layer, module), (a, b) in weights.tensors.items():
        start = base + layout.a_offsets[module]
        assert runner.context.a_pages[layer][start: start + a.numel()].equal(a.reshape(-1))
        start = base + layout.b_offsets[module]
        assert runner.context.b_pages[layer][start: start + b.numel()].equal((b * weights.scaling).reshape(-1))
    assert layout.num_pages == 4 * ALL8_FP32_PAGES
    assert_pool_free(llm)

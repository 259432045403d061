"""The tiers below the pool, through the engine: hits change no token, the disk
tier survives a restart and is shared, bad files are misses, a failing disk
turns itself off, and preemption and swap interleave with tier loads.

A tiny random-weight model keeps these fast; the pool is made a few blocks
big so that every prefix is evicted between the turns that reuse it.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
NUM_PROMPTS = 6


def _prompts(turn: int) -> list[dict]:
    """Multi-turn token prompts: conversation i's turn t repeats turn t-1's
    tokens (5 blocks) and adds a few: the reused prefixes are twice the small pool."""
    prompts = []
    for i in range(NUM_PROMPTS):
        tokens = [(i * 131 + j * 7) % 4000 + 100 for j in range(80)]
        for t in range(turn):
            tokens += [(i * 17 + t * 29 + j) % 4000 + 100 for j in range(9)]
        prompts.append({"prompt_token_ids": tokens})
    return prompts


def _run(llm: LLM, turns: int = 2) -> list[tuple]:
    """Every turn of every conversation, one turn at a time (greedy tokens and logprobs)."""
    results = []
    for turn in range(turns):
        for output in llm.generate(_prompts(turn), GREEDY, use_tqdm=False):
            completion = output.outputs[0]
            results.append((tuple(completion.token_ids),
                            tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                  for step in completion.logprobs)))
    return results


def _assert_same_tokens(results: list[tuple], expected: list[tuple]) -> None:
    """Tokens equal, logprobs within float noise: for runs whose prefix hits
    differ from the reference's (a hit computes fewer tokens per chunk, which
    may round differently: the same holds for pool hits)."""
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in expected]
    for (_, got), (_, want) in zip(results, expected):
        for got_step, want_step in zip(got, want):
            assert [t for t, _ in got_step] == [t for t, _ in want_step]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got_step, want_step)) < 1e-4


def _pool_bytes(llm: LLM) -> dict[bytes, bytes]:
    """The bytes of every hashed block in the pool, by block hash."""
    engine = llm.llm_engine
    cached = dict(engine.kv_cache_manager.block_pool.cached_blocks)
    codec = engine.kv_tiers.runner.host.codec
    payloads = codec.gather(engine.runner.kv_caches, [block.block_id for block in cached.values()])
    return {block_hash: payload.numpy().tobytes() for (_, block_hash), payload in zip(cached, payloads)}


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[tuple]:
    """The same turns on a pool big enough that every reused prefix is a pool hit."""
    llm = LLM(tiny_llama, num_kv_blocks=256, max_num_seqs=2)
    results = _run(llm)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert_pool_free(llm)
    return results


def _small(tiny_llama, **options) -> LLM:
    # int8: and each of the 2 running sequences' 4-block fp32 tail, so they still run side by side.
    num_kv_blocks = 24 if options.get("kv_cache_dtype") == "int8" else 16
    return LLM(tiny_llama, num_kv_blocks=num_kv_blocks, max_num_seqs=2, debug_invariants=True, **options)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_tier_hits_give_the_tokens_and_logprobs_of_pool_hits(tiny_llama, reference, async_scheduling):
    llm = _small(tiny_llama, kv_offload_host_bytes=8 << 20, async_scheduling=async_scheduling)
    assert _run(llm) == reference
    stats = llm.stats()
    assert stats["host_tier_hits"] >= NUM_PROMPTS * 4, stats  # every second turn loads its 5-block prefix
    assert stats["tier_offloads"] > 0 and stats["tier_loaded_bytes"] > 0
    assert_pool_free(llm)
    assert llm.stats()["host_tier_blocks"] == 0  # reset_prefix_cache empties host memory too


def test_without_tiers_the_small_pool_recomputes(tiny_llama, reference):
    llm = _small(tiny_llama)
    assert _run(llm) == reference
    assert llm.stats()["prefix_cache_hits"] < NUM_PROMPTS * 5 * 16
    assert_pool_free(llm)


def test_vllm_kv_transfer_config_spells_the_host_tier(tiny_llama, reference):
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"num_cpu_blocks": 64}}
    llm = _small(tiny_llama, kv_transfer_config=transfer)
    assert llm.llm_engine.kv_tiers.index.host_capacity_blocks == 64
    assert _run(llm) == reference
    assert llm.stats()["host_tier_hits"] > 0
    assert_pool_free(llm)


def test_the_disk_tier_survives_a_restart(tiny_llama, reference, tmp_path):
    first = _small(tiny_llama, kv_offload_dir=str(tmp_path))
    assert _run(first, turns=1) == reference[:NUM_PROMPTS]
    written = _pool_bytes(first)
    assert_pool_free(first)
    first.shutdown()  # finishes the queued writes
    assert first.stats()["disk_tier_files_written"] > 0
    restarted = _small(tiny_llama, kv_offload_dir=str(tmp_path))
    _assert_same_tokens(_run(restarted), reference)
    stats = restarted.stats()
    assert stats["disk_tier_hits"] >= NUM_PROMPTS * 4, stats
    assert stats["tier_fetch_failures"] == 0
    assert stats["tier_fetches"] == stats["disk_tier_hits"]  # each block read once, none dropped before use
    # What came back is what went out, byte for byte (every block both pools still hold).
    loaded = _pool_bytes(restarted)
    common = set(written) & set(loaded)
    assert common and all(loaded[h] == written[h] for h in common)
    assert_pool_free(restarted)
    restarted.shutdown()


def _block_files(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(str(folder), "*", "*", "*.kvblock")))


def test_bad_files_are_counted_removed_and_recomputed(tiny_llama, reference, tmp_path):
    writer = _small(tiny_llama, kv_offload_dir=str(tmp_path))
    _run(writer, turns=1)
    writer.shutdown()
    files = _block_files(tmp_path)
    assert len(files) >= 8
    # One file of each kind of damage (each is some conversation's prefix block).
    truncated, corrupt, foreign, stale = files[:4]
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 100)
    with open(corrupt, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(foreign, "r+b") as f:  # another model's fingerprint
        f.seek(8)
        f.write(b"\x00" * 32)
    with open(stale, "r+b") as f:  # an older format version
        f.seek(6)
        f.write(b"\x00\x00")
    reader = _small(tiny_llama, kv_offload_dir=str(tmp_path))
    _assert_same_tokens(_run(reader), reference)
    stats = reader.stats()
    kinds = {kind: stats[f"disk_tier_{kind}_files"] for kind in ("truncated", "corrupt", "foreign", "stale")}
    assert kinds == {"truncated": 1, "corrupt": 1, "foreign": 1, "stale": 1}, kinds
    assert stats["tier_fetch_failures"] == 4
    assert stats["disk_tier_hits"] > 0  # the sound files still served
    for damaged in (truncated, corrupt, foreign, stale):
        # Removed when found; the recompute wrote the block again, whole.
        assert not os.path.exists(damaged) or os.path.getsize(damaged) == os.path.getsize(files[4])
    assert_pool_free(reader)
    reader.shutdown()


_SUBPROCESS = textwrap.dedent("""
    import json, resource, signal, sys
    from pagedllm import LLM, SamplingParams
    model, folder, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if limit:  # files may not grow past `limit` bytes: every block write fails (EFBIG), like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    llm = LLM(model, num_kv_blocks=16, max_num_seqs=2, kv_offload_dir=folder, debug_invariants=True)
    prompts = [{"prompt_token_ids": [(i * 131 + j * 7) % 4000 + 100 for j in range(80)]} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    stats = llm.stats()
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "enabled": stats["disk_tier_enabled"], "written": stats["disk_tier_files_written"],
                      "free": stats["num_free_blocks"] == stats["num_blocks"]}))
""")


def _in_subprocess(tiny_llama, folder, fsize_limit: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SUBPROCESS, tiny_llama, str(folder), str(fsize_limit)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process: subprocess.Popen) -> dict:
    import json

    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_two_processes_share_one_folder_at_once(tiny_llama, reference, tmp_path):
    processes = [_in_subprocess(tiny_llama, tmp_path) for _ in range(2)]
    results = [_result(p)[0] for p in processes]
    expected = [list(tokens) for tokens, _ in reference[:NUM_PROMPTS]]
    for result in results:
        assert result["tokens"] == expected and result["free"] and result["enabled"]
    assert _block_files(tmp_path)
    # A third engine, in this process, is served by what they wrote.
    llm = _small(tiny_llama, kv_offload_dir=str(tmp_path))
    _assert_same_tokens(_run(llm, turns=1), reference[:NUM_PROMPTS])
    assert llm.stats()["disk_tier_hits"] >= NUM_PROMPTS * 4
    assert llm.stats()["tier_fetch_failures"] == 0
    assert_pool_free(llm)
    llm.shutdown()


def test_a_disk_that_refuses_writes_turns_the_tier_off_and_requests_carry_on(tiny_llama, reference, tmp_path):
    result, err = _result(_in_subprocess(tiny_llama, tmp_path, fsize_limit=1024))
    assert result["tokens"] == [list(tokens) for tokens, _ in reference[:NUM_PROMPTS]]
    assert result["free"] and not result["enabled"] and result["written"] == 0
    assert "KV disk tier turned off" in err
    assert not _block_files(tmp_path)


def test_an_unusable_folder_turns_the_tier_off_at_start(tiny_llama, reference):
    llm = _small(tiny_llama, kv_offload_dir="/proc/pagedllm-kv-tier")  # not creatable, even by root
    assert "turned off" in llm.llm_engine.capacity_line()
    assert _run(llm, turns=1) == reference[:NUM_PROMPTS]
    assert not llm.stats()["disk_tier_enabled"]
    assert_pool_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_and_swap_interleave_with_tier_loads(tiny_llama, tmp_path, preemption_mode):
    """Many requests with shared prefixes on a pool that forces preemption, with
    both tiers: every step's invariants hold and no token changes."""
    prompts = [{"prompt_token_ids": [(c * 131 + j * 7) % 4000 + 100 for j in range(50)]
                + [(r * 13 + j) % 4000 + 100 for j in range(r % 3 * 8)]} for c in range(4) for r in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, num_kv_blocks=512).generate(prompts, params,
                                                                                           use_tqdm=False)]
    llm = LLM(tiny_llama, num_kv_blocks=12, max_num_seqs=4, preemption_mode=preemption_mode, swap_space=0.01,
              kv_offload_host_bytes=8 << 20, kv_offload_dir=str(tmp_path), debug_invariants=True)
    for _ in range(2):  # the second round finds prefixes in both tiers
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["host_tier_hits"] + stats["disk_tier_hits"] > 0, stats
    assert_pool_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("options, message", [
    ({"kv_offload_host_bytes": -1}, "kv_offload_host_bytes"),
    ({"kv_offload_disk_bytes": 1 << 20}, "kv_offload_dir"),
    ({"kv_offload_host_bytes": 1 << 20, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_offload_host_bytes": 1 << 20, "kv_layout": "contiguous"}, "paged"),
    ({"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}, "kv_connector"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 1, "num_cpu_blocks": 2}}},
     "exactly one"),
    ({"kv_offload_host_bytes": 1 << 20, "kv_transfer_config": {
        "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1}}}, "pass one"),
])
def test_bad_tier_options_are_refused_by_name(options, message):
    from pagedllm.config.engine import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)


def test_tiers_show_in_stats_metrics_and_the_pool_view(tiny_llama, reference, tmp_path):
    llm = _small(tiny_llama, kv_offload_host_bytes=8 << 20, kv_offload_dir=str(tmp_path))
    _assert_same_tokens(_run(llm), reference)
    stats = llm.stats()
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value for m in llm.get_metrics() if hasattr(m, "value")}

    def metric(name: str, **labels: str) -> float:
        return metrics[(f"pagedllm:{name}", tuple(sorted({"model_name": tiny_llama, **labels}.items())))]

    assert metric("kv_tier_hits", medium="CPU") == stats["host_tier_hits"] > 0
    assert metric("kv_tier_stored_blocks", medium="DISK") == stats["tier_persists"] > 0
    assert metric("external_prefix_cache_hits") == (stats["host_tier_hits"] + stats["disk_tier_hits"]) * 16
    assert metric("kv_tier_usage_bytes", medium="CPU") == stats["host_tier_bytes"] > 0
    view = llm.kv_pool_snapshot()["tiers"]
    assert view["host"]["hits"] == stats["host_tier_hits"] and view["disk"]["enabled"]
    assert "KV offload tiers: host memory 8.0 MiB" in llm.llm_engine.capacity_line()
    assert_pool_free(llm)
    llm.shutdown()


def test_int8_blocks_go_down_as_int8_with_their_scales(tiny_llama, tmp_path):
    """An int8 pool's tier blocks are its int8 bytes and fp32 scales, and hits give pool hits' outputs."""
    expected = _run(LLM(tiny_llama, num_kv_blocks=256, max_num_seqs=2, kv_cache_dtype="int8"))
    llm = _small(tiny_llama, kv_cache_dtype="int8", kv_offload_host_bytes=8 << 20, kv_offload_dir=str(tmp_path))
    assert _run(llm) == expected  # host hits: the same bytes as the pool's, so the same logprobs
    # Per layer and block: K and V of 16 tokens x 2 KV heads x 16 dims, one byte each, plus an fp32 scale
    # per token and head for each; the fp32 pool's block is 8192 bytes.
    int8_bytes = 2 * (2 * 16 * 2 * 16 + 2 * 16 * 2 * 4)
    assert llm.llm_engine.kv_tiers.block_bytes == int8_bytes == 2560
    llm.shutdown()
    sizes = {os.path.getsize(path) for path in _block_files(tmp_path)}
    assert sizes == {112 + int8_bytes}
    assert llm.stats()["host_tier_hits"] > 0
    assert_pool_free(llm)

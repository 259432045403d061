"""The tiers below the pool with a hybrid KV layout (``core.kv_groups``), against Hugging Face.

A tiny random Gemma 3 (5 sliding layers of window 8 to 1 global layer: 6 KV cache groups of
one layer) in a pool too small to keep a long prefix: the prefix goes down to the host tier
(or is written to the disk tier) per group, is evicted from the pool by other prompts, and
comes back when a prompt repeats it: the global group loads every block before the hit
point, each sliding group only those inside the window there. Greedy output equals Hugging
Face's free-running ``generate``, the hit shows in ``num_cached_tokens``, and the pool is
all-free after each engine. The disk tier serves the prefix again after a restart. A model
whose every layer slides (one group with a window, Mistral) keeps the tiers too.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.core.kv_groups import kv_group_layout
from pagedllm.kv_tiers.fingerprint import tier_fingerprint
from tests.conftest import assert_pool_free
from tests.engine.test_sliding_window import greedy, hf_greedy, prompts

NEW_TOKENS = 8
SHARED = 64  # tokens of the first prompt the repeat shares (16 blocks of 4)


def _llm(folder: str, num_kv_blocks: int = 64, **tiers) -> LLM:
    # 64 blocks: one prompt runs (78 tokens: its global group holds 20 blocks, each sliding group up to 7),
    # and the next prompts evict what the first one left cached.
    return LLM(folder, num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
               debug_invariants=True, **tiers)


def _generate(llm: LLM, hf_model, batch: list[list[int]]) -> list:
    """One prompt at a time (each evicts the one before); every output is Hugging Face's."""
    outputs = []
    for prompt in batch:
        (output,) = llm.generate([{"prompt_token_ids": prompt}], greedy(NEW_TOKENS), use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
        outputs.append(output)
    return outputs


def _batches(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Three prompts of 70 tokens with nothing in common, and a repeat of the first's 64 tokens."""
    first, *others = prompts(llm.get_tokenizer(), [70, 70, 70])  # each 3 tokens on: no block hash in common
    assert all(len(prompt) == 70 for prompt in others)
    return [first, *others], first[:SHARED] + others[0][:9]


def _gemma3(tiny_gemma_dir):
    folder, hf_model = tiny_gemma_dir("gemma3")
    return folder, hf_model


@pytest.mark.slow
def test_the_host_tier_brings_an_evicted_prefix_back_per_group(tiny_gemma_dir):
    folder, hf_model = _gemma3(tiny_gemma_dir)
    llm = _llm(folder, kv_offload_host_bytes=1 << 20)
    assert llm.llm_engine.kv_cache_manager.num_groups == 6
    batch, repeat = _batches(llm)
    _generate(llm, hf_model, batch)
    (output,) = _generate(llm, hf_model, [repeat])
    assert output.num_cached_tokens == SHARED
    stats = llm.stats()
    # The global group's 16 blocks and each sliding group's 2 in the window at token 64, from host memory.
    assert stats["host_tier_hits"] >= 16 + 5 * 2, stats
    assert 0 < stats["tier_hit_tokens"] <= SHARED  # tokens: group 0's loads only
    assert_pool_free(llm)


@pytest.mark.slow
def test_the_disk_tier_brings_an_evicted_prefix_back_per_group_and_after_a_restart(tiny_gemma_dir,
                                                                                  tmp_path):
    folder, hf_model = _gemma3(tiny_gemma_dir)
    first = _llm(folder, kv_offload_dir=str(tmp_path))
    batch, repeat = _batches(first)
    _generate(first, hf_model, batch)
    (output,) = _generate(first, hf_model, [repeat])
    assert output.num_cached_tokens == SHARED
    assert first.stats()["disk_tier_hits"] >= 16 + 5 * 2
    assert_pool_free(first)
    first.shutdown()  # finishes the queued writes
    restarted = _llm(folder, kv_offload_dir=str(tmp_path))
    assert restarted.llm_engine.kv_tiers.fingerprint == first.llm_engine.kv_tiers.fingerprint
    (output,) = _generate(restarted, hf_model, [repeat])
    # The first engine wrote the repeat's own blocks too: all of it but the last token's block hits.
    assert output.num_cached_tokens == (len(repeat) - 1) // 4 * 4
    stats = restarted.stats()
    assert stats["disk_tier_hits"] >= 16 + 5 * 2 and stats["tier_fetch_failures"] == 0, stats
    assert_pool_free(restarted)
    restarted.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_model_whose_every_layer_slides_keeps_the_tiers(sliding_model, tmp_path, medium):
    """One group with a window of 12 (Mistral): the repeat needs only the 3 blocks its window
    reads at token 64, which the other prompts evicted from the pool (16 blocks: a prompt
    holds at most 8); the search for the hit point walks back from the repeat's own blocks."""
    folder, hf_model = sliding_model("mistral")
    tiers = {"kv_offload_host_bytes": 1 << 20} if medium == "host" else {"kv_offload_dir": str(tmp_path)}
    llm = _llm(folder, num_kv_blocks=16, **tiers)
    batch, repeat = _batches(llm)
    _generate(llm, hf_model, batch)
    (output,) = _generate(llm, hf_model, [repeat])
    assert output.num_cached_tokens == SHARED
    assert llm.stats()[f"{medium}_tier_hits"] >= 3
    assert_pool_free(llm)
    llm.shutdown()


def test_a_hybrid_layouts_fingerprint_names_its_groups_and_one_group_keeps_its_old_one(tmp_path):
    """A hybrid block holds one group's layers in its slots: even a pool of the same slab
    shapes must not meet it on disk. One group adds nothing: existing folders stay valid."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    args = (str(weights), "float32", "auto", 4, "layout-digest", "auto")
    before_groups = tier_fingerprint(*args)
    assert tier_fingerprint(*args, kv_group_layout([None, None])) == before_groups
    hybrid = tier_fingerprint(*args, kv_group_layout([8, None]))
    assert hybrid != before_groups and hybrid != tier_fingerprint(*args, kv_group_layout([16, None]))

"""KV cache groups from each layer's window (``core.kv_groups``): which layers share a
table, in equal-size groups of one pool, and what a request holds in them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config.cache import CacheConfig
from pagedllm.config.engine import EngineConfig
from pagedllm.core.kv_groups import KVGroupLayout, KVGroupSpec, kv_group_layout

GEMMA3 = [512 if (layer + 1) % 6 else None for layer in range(18)]  # 5 local layers of every 6


def test_gemma3_groups_its_global_layers_first_then_its_local_layers_in_threes():
    layout = kv_group_layout(GEMMA3)
    assert [group.layers for group in layout.groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert layout.num_slots == 3 and layout.is_hybrid
    for layer in range(18):
        group = layout.groups[layout.group_of_layer[layer]]
        assert group.layers[layout.slot_of_layer[layer]] == layer
        assert group.window == GEMMA3[layer]


def test_hybrid_memory_at_16k_tokens_is_under_a_third_of_keeping_every_block():
    hybrid, full = kv_group_layout(GEMMA3), kv_group_layout(GEMMA3, hybrid=False)
    assert full.groups == (KVGroupSpec("full", tuple(range(18))),)
    held = {layout: layout.blocks_held(16384, 16) * layout.num_slots for layout in (hybrid, full)}
    assert held[full] == 1024 * 18
    assert held[hybrid] / held[full] < 0.3


@pytest.mark.parametrize("windows, kinds", [
    ([None] * 4, [("full", None, (0, 1, 2, 3))]),
    ([8] * 3, [("sliding_window", 8, (0, 1, 2))]),  # Mistral: one sliding group
    ([None, 8] * 2, [("full", None, (0, 2)), ("sliding_window", 8, (1, 3))]),  # Gemma 2, gpt-oss
    ([8, 8, 8, None], [("full", None, (3,)), ("sliding_window", 8, (0,)), ("sliding_window", 8, (1,)),
                       ("sliding_window", 8, (2,))]),  # Cohere 2's 3:1
    ([None, None, None, 4, 4, 4, 4], [("full", None, (0, 1, 2)), ("sliding_window", 4, (3, 4, 5)),
                                      ("sliding_window", 4, (6,))]),  # Qwen2's max_window_layers
    ([16, None, 8, 8], [("full", None, (1,)), ("sliding_window", 8, (2,)), ("sliding_window", 8, (3,)),
                        ("sliding_window", 16, (0,))]),
])
def test_layers_group_by_kind_full_first_in_groups_of_the_smallest_kind(windows, kinds):
    layout = kv_group_layout(windows)
    assert [(group.kind, group.window, group.layers) for group in layout.groups] == kinds


def test_without_the_hybrid_manager_a_mixed_model_has_one_full_group():
    layout = kv_group_layout([None, 8, 8], hybrid=False)
    assert layout.groups == (KVGroupSpec("full", (0, 1, 2)),) and not layout.is_hybrid
    assert kv_group_layout([8, 8], hybrid=False).windows == (8,)  # all sliding: it still slides


def test_the_engine_config_groups_the_models_layers_unless_told_not_to():
    assert EngineConfig().scheduler_config(4096, [None, 8]).kv_groups == kv_group_layout([None, 8])
    off = EngineConfig(cache=CacheConfig(disable_hybrid_kv_cache_manager=True))
    assert off.scheduler_config(4096, [None, 8]).kv_groups.groups == (KVGroupSpec("full", (0, 1)),)
    assert EngineConfig().scheduler_config(4096).kv_groups is None


@pytest.mark.parametrize("windows", [[], [0], [None, -1], [True]])
def test_bad_windows_are_refused(windows):
    with pytest.raises(ValueError):
        kv_group_layout(windows)


def test_a_layout_must_cover_every_layer_once():
    with pytest.raises(ValueError, match="cover layers"):
        KVGroupLayout((KVGroupSpec("full", (0, 2)),), 3)
    with pytest.raises(ValueError, match="window"):
        KVGroupSpec("full", (0,), 8)


def test_the_contiguous_layout_is_refused_with_groups_naming_the_escape_hatch():
    config = EngineConfig(cache=CacheConfig(kv_layout="contiguous"))
    with pytest.raises(ValueError, match="split into 2 groups.*--disable-hybrid-kv-cache-manager"):
        config.scheduler_config(64, [8, None])
    # One group runs it as before; so does a model whose layers all attend alike.
    # (int8, a draft model, LoRA and the tiers run with groups: test_hybrid_int8.py,
    # test_hybrid_speculation.py, test_lora_hybrid.py, test_hybrid_tiers.py.)
    one_group = replace(config, cache=replace(config.cache, disable_hybrid_kv_cache_manager=True))
    assert not one_group.scheduler_config(64, [8, None]).kv_groups.is_hybrid
    assert config.scheduler_config(64, [None, None]).kv_groups.num_groups == 1


@given(window=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 8]), max_step=st.integers(1, 24),
       num_tokens=st.integers(2, 120), data=st.data())
@settings(max_examples=150, deadline=None)
def test_admissions_bound_is_the_most_a_request_holds_in_the_real_manager(window, block_size, max_step,
                                                                          num_tokens, data):
    """A request of ``num_tokens`` tokens run in steps of at most ``max_step`` tokens, in a
    full and a sliding group: the blocks it holds never pass ``most_blocks_held``."""
    assert_admissions_bound_holds(kv_group_layout([None, window]), block_size, max_step, num_tokens, data)


def assert_admissions_bound_holds(layout: KVGroupLayout, block_size: int, max_step: int, num_tokens: int,
                                  data) -> None:
    """Run one request in the real manager in random steps of at most ``max_step`` tokens
    (drawn from hypothesis' ``data``) and check the blocks it holds against the layout's bound."""
    from pagedllm.core.kv_cache_manager import KVCacheManager

    bound = layout.most_blocks_held(num_tokens, block_size, max_step)
    manager = KVCacheManager(4 * bound + 8, block_size, enable_prefix_caching=False, windows=layout.kinds)
    computed, most = 0, 0
    while computed < num_tokens:
        step = data.draw(st.integers(1, min(max_step, num_tokens - computed)))
        assert manager.allocate_slots("r", computed, step) is not None
        computed += step
        most = max(most, manager.num_blocks - manager.num_free_blocks)
    assert most <= bound
    manager.free("r")
    assert manager.num_free_blocks == manager.num_blocks

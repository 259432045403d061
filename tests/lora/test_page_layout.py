"""Where an adapter's matrices sit in its pages, and how many pages it takes (pure arithmetic)."""

from __future__ import annotations

from transformers import LlamaConfig

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.lora.page_layout import adapter_layout, pages_on_every_rank, projection_shapes
from pagedllm.lora.weights import LORA_MODULES

# SmolLM2-135M's shapes: 9 heads of 64, 3 KV heads, MLP 1536.
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3)
FP32_PAGE = 16 * 3 * 64  # one block's key rows of one layer: block_size x KV heads x head_dim


def test_a_rank16_adapter_on_every_projection_of_smollm2_takes_27_fp32_blocks():
    # The B matrices are the larger half: 16 x (576 + 192 + 192 + 576 + 1536 + 1536 + 576) = 82,944
    # values per layer, 27 pages of 3,072 in the value rows.
    layout = adapter_layout(16, LORA_MODULES, projection_shapes(SMOLLM2), FP32_PAGE)
    assert layout.num_pages == 27
    # An int8 pool's block holds a quarter as many fp32 values: 82,944 / 768 = 108 pages.
    assert adapter_layout(16, LORA_MODULES, projection_shapes(SMOLLM2), FP32_PAGE // 4).num_pages == 108


def test_matrices_are_aligned_and_never_overlap():
    shapes = projection_shapes(SMOLLM2)
    layout = adapter_layout(8, ("q_proj", "v_proj", "down_proj"), shapes, FP32_PAGE)
    for offsets, size in ((layout.a_offsets, lambda m: 8 * shapes[m][0]), (layout.b_offsets, lambda m: shapes[m][1] * 8)):
        spans = sorted((offset, offset + size(module)) for module, offset in offsets.items())
        assert all(start % 16 == 0 for start, _ in spans)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= layout.num_pages * FP32_PAGE
    assert set(layout.a_offsets) == {"q_proj", "v_proj", "down_proj"}


def test_tensor_parallel_pages_cover_the_rank_with_the_most_to_hold():
    # 3 KV heads over 2 ranks: rank 0 holds 2 (pages of 2048 values), rank 1 holds 1 (1024).
    ranks = [TensorParallelGroup(r, 2) for r in range(2)]
    needs = [adapter_layout(16, LORA_MODULES, projection_shapes(SMOLLM2, group), page).num_pages
             for group, page in zip(ranks, (2048, 1024))]
    assert needs[1] > needs[0]  # rank 1's pages are half as large but its adapter shard is not
    assert pages_on_every_rank(16, LORA_MODULES, SMOLLM2, 2, 2048) == max(needs)
    assert projection_shapes(SMOLLM2, ranks[1])["o_proj"] == (3 * 64, 576)  # its share of o's input columns


def test_a_hybrid_pool_gives_each_kv_cache_group_its_own_stretch_of_the_run():
    """Layers of different groups share one slot tensor, so each group's layers keep their
    weights in their own stretch: the run is num_groups stretches, group g's after g of them."""
    one = adapter_layout(16, LORA_MODULES, projection_shapes(SMOLLM2), FP32_PAGE)
    six = adapter_layout(16, LORA_MODULES, projection_shapes(SMOLLM2), FP32_PAGE, num_groups=6)
    assert (six.num_pages, six.num_blocks, one.num_blocks) == (27, 6 * 27, 27)
    assert [six.page_start(100, group, FP32_PAGE) for group in (0, 1, 5)] == [
        100 * FP32_PAGE, 127 * FP32_PAGE, (100 + 5 * 27) * FP32_PAGE]
    assert six.page_start(100, 5, FP32_PAGE) + six.num_pages * FP32_PAGE == (100 + six.num_blocks) * FP32_PAGE
    assert pages_on_every_rank(16, LORA_MODULES, SMOLLM2, 1, FP32_PAGE, num_groups=6) == 6 * 27

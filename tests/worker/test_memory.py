"""Pool planning: the sizing rules in their order, swap blocks, bytes per token,
vLLM's gpu_memory_utilization arithmetic and the profiling step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm import LLM
from pagedllm.attention.kv_cache import allocate_layer
from pagedllm.attention.selector import attention_backend_for
from pagedllm.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.core.kv_groups import KVGroupLayout, kv_group_layout
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.shapes import head_dim_of
from pagedllm.worker import memory
from pagedllm.worker.memory import plan_kv_pool, run_dummy_step, utilization_kv_budget
from tests.conftest import TINY_COMMON

GIB = 2**30
CPU = torch.device("cpu")
# The tiny Llama: 2 layers x 2 KV heads x head_dim 16, K and V: 512 bytes per token in fp32.
TINY_FP32_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def tiny_model(world_size: int = 1) -> LlamaForCausalLM:
    """Rank 0's shard of a random tiny Llama: planning reads its shape, not its weights."""
    from transformers import LlamaConfig

    return LlamaForCausalLM(LlamaConfig(**TINY_COMMON, vocab_size=256), tp=TensorParallelGroup(0, world_size))


def plan(device: torch.device = CPU, world_size: int = 1, preemption_mode: str = "recompute",
         swap_space: float = 4.0, **cache_options) -> memory.PoolPlan:
    config = EngineConfig(cache=CacheConfig(**cache_options), preemption_mode=preemption_mode, swap_space=swap_space,
                          tensor_parallel_size=world_size)
    return plan_kv_pool(config, tiny_model(world_size), SchedulerConfig(max_model_len=64), device)


@pytest.mark.parametrize(
    ("options", "expected_blocks"),
    [
        # num_kv_blocks wins over every memory rule.
        (dict(num_kv_blocks=5, kv_cache_memory=GIB, kv_cache_fraction=0.5), 5),
        # Then kv_cache_memory, over kv_cache_fraction.
        (dict(kv_cache_memory=100 * 512 * 16, kv_cache_fraction=0.5), 100),
        # Then the fraction of available memory (8 MiB, faked below).
        (dict(kv_cache_fraction=0.25), 2 * 2**20 // (512 * 16)),
        # Then, on CPU, the default budget.
        (dict(), CacheConfig.DEFAULT_KV_CACHE_MEMORY // (512 * 16)),
    ],
)
def test_pool_size_follows_the_first_rule_that_is_set(options, expected_blocks, monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 8 * 2**20)
    planned = plan(**options)
    assert (planned.num_blocks, planned.block_size, planned.num_tokens) == (expected_blocks, 16, expected_blocks * 16)


def test_a_budget_that_holds_no_block_names_what_to_raise():
    with pytest.raises(ValueError, match=r"the KV budget of 8000 bytes holds no block of 16 tokens \(8192 bytes\); "
                                         "raise kv_cache_memory or kv_cache_fraction"):
        plan(kv_cache_memory=8000)


def test_tensor_parallel_on_gpus_needs_an_explicit_pool_size():
    """Sizing from GPU memory runs a forward the other ranks would not join."""
    with pytest.raises(ValueError, match="with tensor_parallel_size > 1 on GPUs, size the pool with kv_cache_memory"):
        plan(torch.device("cuda"), world_size=2, kv_cache_fraction=0.5)
    assert plan(world_size=2, kv_cache_fraction=0.5).num_blocks > 0  # on CPU the fraction is measured


@pytest.mark.parametrize(
    ("preemption_mode", "kv_layout", "expected_swap_blocks"),
    [("swap", "paged", GIB // (512 * 16)), ("recompute", "paged", 0), ("swap", "contiguous", 0)],
)
def test_swap_blocks_only_for_swap_preemption_of_a_paged_pool(preemption_mode, kv_layout, expected_swap_blocks):
    planned = plan(preemption_mode=preemption_mode, swap_space=1.0, kv_layout=kv_layout, num_kv_blocks=8)
    assert planned.num_swap_blocks == expected_swap_blocks


def test_bytes_per_token_int8_against_the_model_dtype():
    auto = plan(num_kv_blocks=8)
    int8 = plan(num_kv_blocks=8, kv_cache_dtype="int8")
    assert (auto.bytes_per_token, auto.unquantized_bytes_per_token) == (TINY_FP32_BYTES_PER_TOKEN,) * 2
    # 1-byte values plus one fp32 scale per (token, KV head), for K and for V.
    assert int8.bytes_per_token == int8.total_bytes_per_token == 2 * 2 * 2 * (16 + 4)
    assert int8.unquantized_bytes_per_token == TINY_FP32_BYTES_PER_TOKEN
    assert "int8 KV with per-token scales) on cpu; 3.20x the tokens of a float32 pool" in int8.capacity_line()


@pytest.mark.parametrize(("speculative", "kv_layout", "expected_tails"), [
    (None, "paged", 1),  # one per sequence
    ({"method": "ngram", "num_speculative_tokens": 4}, "paged", 2),  # and one for drafts past a block
    ({"method": "ngram", "num_speculative_tokens": 20}, "paged", 3),
    (None, "contiguous", 0),  # the baseline holds none (its partial blocks read as int8)
])
def test_int8_tails_are_runs_of_the_pools_own_blocks(speculative, kv_layout, expected_tails):
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=100, kv_cache_dtype="int8", kv_layout=kv_layout),
                          speculative_config=speculative)
    planned = plan_kv_pool(config, tiny_model(), SchedulerConfig(max_model_len=64, max_num_seqs=256), CPU)
    # An fp32 tail takes 4 int8 blocks' bytes; nothing is set aside, whatever max_num_seqs.
    assert (planned.num_blocks, planned.tails_per_request) == (100, expected_tails)
    assert planned.tail_run_blocks == (4 if expected_tails else 0)
    if expected_tails:
        assert planned.capacity_line().endswith(
            f"; a writing sequence also keeps its still-filling blocks in float32, in tails of 4 of these blocks "
            f"({expected_tails} per sequence)")
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        assert plan(num_kv_blocks=8, kv_cache_dtype=kv_cache_dtype).tail_run_blocks == 0


@pytest.mark.parametrize("max_num_seqs", [4, 256])
def test_an_int8_budget_is_all_blocks(max_num_seqs):
    """kv_cache_memory is int8 blocks only: tails are taken from them as sequences
    write, so nothing is set aside and no cap on sequences follows."""
    budget = 1 << 20
    scheduler = SchedulerConfig(max_model_len=64, max_num_seqs=max_num_seqs)
    planned = plan_kv_pool(EngineConfig(cache=CacheConfig(kv_cache_memory=budget, kv_cache_dtype="int8")),
                           tiny_model(), scheduler, CPU)
    assert planned.num_blocks == budget // (16 * planned.bytes_per_token)
    auto = plan_kv_pool(EngineConfig(cache=CacheConfig(kv_cache_memory=budget)), tiny_model(), scheduler, CPU)
    assert auto.num_blocks == budget // (16 * TINY_FP32_BYTES_PER_TOKEN) and auto.tail_run_blocks == 0


def smollm2_shaped_model() -> LlamaForCausalLM:
    """SmolLM2-135M's KV shape (30 layers x 3 KV heads x head_dim 64: 46,080 fp32
    bytes a token) on a tiny body: planning reads the shape, not the weights."""
    from transformers import LlamaConfig

    return LlamaForCausalLM(LlamaConfig(hidden_size=192, intermediate_size=64, num_hidden_layers=30,
                                        num_attention_heads=3, num_key_value_heads=3, vocab_size=256),
                            tp=TensorParallelGroup(0, 1))


def test_smollm2_int8_at_64_mib_and_256_sequences_stays_within_the_budget():
    """Issue 41: the tails used to sit beside kv_cache_memory (342 int8 blocks of
    64 MiB plus 180 MiB of tails). Issue 55: a slot set aside for each of 256
    sequences left 71 blocks (1,136 tokens, fewer than fp32's 1,456); tails now
    come out of the 342 blocks as sequences write."""
    budget = 64 * 2**20
    scheduler = SchedulerConfig(max_model_len=2048, max_num_seqs=256)
    int8 = plan_kv_pool(EngineConfig(cache=CacheConfig(kv_cache_memory=budget, kv_cache_dtype="int8")),
                        smollm2_shaped_model(), scheduler, CPU)
    # int8 + an fp32 scale per vector: 30 x 3 x 2 x (64 + 4) bytes a token; 64 MiB // 195,840 bytes a block.
    assert (int8.bytes_per_token, int8.num_blocks, int8.tail_blocks_per_request) == (12_240, 342, 4)
    # The same budget in the model dtype: 64 MiB // 737,280 bytes a block.
    auto = plan_kv_pool(EngineConfig(cache=CacheConfig(kv_cache_memory=budget)), smollm2_shaped_model(), scheduler,
                        CPU)
    assert (auto.num_blocks, auto.tail_run_blocks) == (91, 0)
    assert int8.capacity_line() == (
        "KV cache: 342 blocks x 16 tokens = 5472 tokens (12240 bytes/token, 63.9 MiB, int8 KV with per-token "
        "scales) on cpu; 3.76x the tokens of a float32 pool of the same size; a writing sequence also keeps its "
        "still-filling blocks in float32, in tails of 4 of these blocks (1 per sequence)"
    )


SMOLLM2_FP32_BLOCK = 16 * 46_080  # 720 KiB


def test_a_pool_too_small_for_tails_to_pay_runs_without_them():
    """Issue 55, SmolLM2's shape: at one fp32 block (720 KiB) int8 has 3 blocks and at
    1 MiB 5, no more beside a 4-block tail than fp32's one, so those pools keep no
    tails (every key read as int8) and hold 3x and 5x fp32's tokens; from two fp32
    blocks (7 int8 ones) up the tails pay, and the capacity line says which."""
    model, scheduler = smollm2_shaped_model(), SchedulerConfig(max_model_len=2048, max_num_seqs=256)
    pools = {budget: plan_kv_pool(EngineConfig(cache=CacheConfig(kv_cache_memory=budget, kv_cache_dtype="int8")),
                                  model, scheduler, CPU)
             for budget in (SMOLLM2_FP32_BLOCK, 2**20, 2 * SMOLLM2_FP32_BLOCK)}
    assert [(p.num_blocks, p.tail_run_blocks, p.tails_per_request) for p in pools.values()] == [
        (3, 0, 0), (5, 0, 0), (7, 4, 1)]
    assert pools[2**20].capacity_line() == (
        "KV cache: 5 blocks x 16 tokens = 80 tokens (12240 bytes/token, 0.9 MiB, int8 KV with per-token scales) on "
        "cpu; 3.76x the tokens of a float32 pool of the same size; no full-precision tails: the pool is too small "
        "for them to pay (beside one sequence's tails, 4 blocks, it would hold no more blocks than a float32 pool of "
        "the same memory, 1; they pay from 6 blocks), so still-filling blocks are read as int8")
    assert pools[2 * SMOLLM2_FP32_BLOCK].capacity_line().endswith("in tails of 4 of these blocks (1 per sequence)")
    # num_kv_blocks: the blocks' own bytes are the memory (tiny Llama: 5 or 6 int8 blocks hold 1 fp32 block's).
    assert [plan(num_kv_blocks=n, kv_cache_dtype="int8").tail_run_blocks for n in (5, 6)] == [0, 4]


def _model_and_groups(shape: str) -> tuple[LlamaForCausalLM, KVGroupLayout | None]:
    """A model of the named KV shape, and its KV cache groups (None: one group)."""
    if shape == "smollm2":
        return smollm2_shaped_model(), None
    from transformers import LlamaConfig

    if shape == "head_dim 128":  # 4 layers x 8 KV heads x 128
        return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                                            vocab_size=256), tp=TensorParallelGroup(0, 1)), None
    return tiny_model(), HYBRID if shape == "tiny, 2 groups" else None


@pytest.mark.parametrize(("shape", "speculative", "tails"), [
    ("smollm2", None, 1), ("smollm2", {"method": "ngram", "num_speculative_tokens": 20}, 3), ("tiny", None, 1),
    ("tiny, 2 groups", None, 2), ("head_dim 128", None, 1)])
def test_int8_holds_more_tokens_than_fp32_in_every_budget(shape, speculative, tails):
    """Issue 55: from a budget of one fp32 block up, int8 holds more tokens than fp32,
    after one sequence's tails where the pool keeps them (one per KV group, and
    more for drafts past a block); and more than three times as many once the
    budget holds a few dozen fp32 blocks."""
    model, groups = _model_and_groups(shape)
    scheduler = SchedulerConfig(max_model_len=64, kv_groups=groups)

    def planned(budget: int, dtype: str) -> memory.PoolPlan:
        cache = CacheConfig(kv_cache_memory=budget, kv_cache_dtype=dtype)
        return plan_kv_pool(EngineConfig(cache=cache, speculative_config=speculative), model, scheduler, CPU)

    fp32_block = planned(2**30, "auto").bytes_per_token * 16
    budgets = [fp32_block + i * fp32_block // 7 for i in range(7 * 40)] + [2**k for k in range(21, 31)]
    for budget in budgets:
        int8, fp32 = planned(budget, "int8"), planned(budget, "auto")
        assert (int8.num_blocks - int8.tail_blocks_per_request) * 16 > fp32.num_tokens, (budget, int8)
        assert int8.pool_bytes <= budget
        if budget >= 40 * fp32_block:
            assert (int8.tail_run_blocks, int8.tails_per_request) == (4, tails)
            assert int8.num_tokens > 3 * fp32.num_tokens


def test_int8_holds_at_least_a_16_bit_pools_tokens():
    """Against a 16-bit model dtype int8 saves less than half (64 + 4 bytes against
    128 a vector for SmolLM2): at one bf16 block it ties (1 block each), from two up it
    holds more, after its tails (2-block runs) once it keeps them."""
    model, scheduler = smollm2_shaped_model(), SchedulerConfig(max_model_len=64)
    bf16_block = 16 * 23_040

    def planned(budget: int, dtype: str) -> memory.PoolPlan:
        config = EngineConfig(dtype="bfloat16", cache=CacheConfig(kv_cache_memory=budget, kv_cache_dtype=dtype))
        return plan_kv_pool(config, model, scheduler, CPU)

    for i in range(7 * 20):
        budget = bf16_block + i * bf16_block // 7
        int8, bf16 = planned(budget, "int8"), planned(budget, "auto")
        beside = int8.num_blocks - int8.tail_blocks_per_request
        assert beside > bf16.num_blocks if budget >= 2 * bf16_block else beside >= bf16.num_blocks == 1
    assert planned(bf16_block, "int8").num_blocks == 1
    assert planned(20 * bf16_block, "int8").tail_run_blocks == 2


def test_the_capacity_line_states_swap_space_and_the_sum():
    """Every byte of the pool: blocks, tails, swap space (allocated up front) and
    their sum; the offload tiers are KVChannels.describe's sentence, not here."""
    planned = plan(preemption_mode="swap", swap_space=1.0, num_kv_blocks=64, kv_cache_dtype="int8")
    blocks = 64 * 16 * planned.bytes_per_token  # the tails are some of the blocks
    swap = planned.num_swap_blocks * 16 * planned.bytes_per_token
    assert swap == GIB // (16 * planned.bytes_per_token) * 16 * planned.bytes_per_token
    line = planned.capacity_line()
    assert line.startswith("KV cache: 64 blocks x 16 tokens = 1024 tokens (160 bytes/token, 0.2 MiB, ")
    assert line.endswith(f"; host swap space {planned.num_swap_blocks} blocks ({swap / 2**20:.1f} MiB, taken as used, "
                         f"plus {16 * TINY_FP32_BYTES_PER_TOKEN} bytes per swapped block that carries a tail); "
                         f"in all {(blocks + swap) / 2**20:.1f} MiB")
    # On a GPU the sum is split between the device and host memory.
    gpu = dataclasses.replace(planned, device_type="cuda")
    assert gpu.capacity_line().endswith(
        f"; in all {(blocks + swap) / 2**20:.1f} MiB ({blocks / 2**20:.1f} MiB on cuda, "
        f"{swap / 2**20:.1f} MiB of host memory)")
    # The draft model's pool counts in the sum; without swap space it is all on the device.
    drafted = dataclasses.replace(planned, num_swap_blocks=0, draft_bytes_per_token=100, device_type="cuda")
    assert drafted.capacity_line().endswith(
        f"; the draft model's pool over the same blocks: 100 bytes/token, {1024 * 100 / 2**20:.1f} MiB; "
        f"in all {(blocks + 1024 * 100) / 2**20:.1f} MiB")


def test_a_budget_too_small_for_a_block_is_refused():
    config = EngineConfig(cache=CacheConfig(kv_cache_memory=2000, kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="holds no block.*raise kv_cache_memory"):
        plan_kv_pool(config, tiny_model(), SchedulerConfig(max_model_len=64), CPU)


def test_a_rank_plans_with_its_own_kv_heads():
    """Two ranks split the 2 KV heads: the budget buys blocks of rank 0's half."""
    planned = plan(world_size=2, kv_cache_memory=100 * 256 * 16)
    assert (planned.num_blocks, planned.bytes_per_token, planned.total_bytes_per_token) == (
        100, TINY_FP32_BYTES_PER_TOKEN // 2, TINY_FP32_BYTES_PER_TOKEN)
    assert planned.capacity_line() == (
        "KV cache: 100 blocks x 16 tokens = 1600 tokens (256 bytes/token, 0.4 MiB, float32) on cpu; "
        "that is rank 0, with 1 of 2 KV heads; all 2 ranks together: 512 bytes/token, 0.8 MiB"
    )


def test_utilization_budget_is_what_weights_and_activations_leave():
    assert utilization_kv_budget(80 * GIB, 0.9, 16 * GIB, 2 * GIB) == int(72 * GIB) - 18 * GIB


def test_utilization_budget_with_no_room_names_what_to_change():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization or lower max_num_batched_tokens") as info:
        utilization_kv_budget(10 * GIB, 0.5, 4 * GIB, 1 * GIB)
    assert "allows 5.00 GiB" in str(info.value) and "weights take 4.00 GiB" in str(info.value)


def test_gpu_memory_utilization_is_refused_on_cpu(tiny_llama):
    with pytest.raises(ValueError, match="gpu_memory_utilization applies to CUDA devices"):
        LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLM(tiny_llama, gpu_memory_utilization=0.0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_dummy_step_writes_every_token_into_its_throwaway_pool(tiny_llama, monkeypatch, kv_cache_dtype):
    """The profiling step is a real forward of the largest step: it must store
    K/V for all of its tokens (so the attention path it measures is the real
    one), and with int8 its still-filling last block's into a tail too."""
    llm = LLM(tiny_llama, num_kv_blocks=8, device="cpu")
    model = llm.llm_engine.model
    config = llm.llm_engine.model_config
    layers = []

    def recording_allocate(*args, **kwargs):
        layers.append(allocate_layer(*args, **kwargs))
        layers[-1].pretouch()  # zeros (the pool is allocated uninitialised): a written slot shows as non-zero
        return layers[-1]

    monkeypatch.setattr(memory, "allocate_layer", recording_allocate)
    tails = kv_cache_dtype == "int8"
    run_dummy_step(model, attention_backend_for(torch.device("cpu"), 16, kv_cache_dtype, tails=tails), num_tokens=40,
                   num_logit_rows=8, block_size=16, kv_shape=(config.num_key_value_heads, head_dim_of(config)),
                   dtype=torch.float32, kv_cache_dtype=kv_cache_dtype, device=torch.device("cpu"))
    assert len(layers) == config.num_hidden_layers
    for layer in layers:
        for pool in (layer.key, layer.value):
            # With int8, 4 more blocks past the prompt's (rounded up to 4) hold one fp32 tail.
            assert pool.shape[:2] == ((8 if tails else 3), 16)
            written = pool.reshape(pool.shape[0] * 16, -1).abs().sum(-1) > 0
            assert written[:40].all() and not written[40:64].any()
        assert layer.has_tails == tails
        if tails:
            # Tokens 32-39 are the last block's: the first 8 positions of tail slot 1 (blocks 4-7).
            written = layer.tail_key[1].view(16, -1).abs().sum(-1) > 0
            assert written[:8].all() and not written[8:].any()


# The tiny Llama's 2 layers as a hybrid layout: layer 0 slides (window 8), layer 1 attends fully,
# so two groups of one layer each and a block holds one layer's K/V.
HYBRID = kv_group_layout([8, None])


def hybrid_plan(groups: KVGroupLayout | None = HYBRID, **engine_options) -> memory.PoolPlan:
    config = EngineConfig(cache=CacheConfig(kv_cache_memory=GIB // 64), **engine_options)
    return plan_kv_pool(config, tiny_model(), SchedulerConfig(max_model_len=64, kv_groups=groups), CPU)


def test_a_hybrid_pool_holds_num_layers_over_num_slots_times_the_blocks():
    """A block holds num_slots layers' K/V, so the same bytes buy num_layers / num_slots
    times the blocks; the start-up line keeps its start and states the groups."""
    one_group, hybrid = hybrid_plan(None), hybrid_plan()
    assert (HYBRID.num_groups, HYBRID.num_slots) == (2, 1)
    assert hybrid.num_blocks == 2 * one_group.num_blocks
    assert hybrid.bytes_per_token == one_group.bytes_per_token // 2 == TINY_FP32_BYTES_PER_TOKEN // 2
    assert hybrid.pool_bytes == one_group.pool_bytes
    per_layer = TINY_FP32_BYTES_PER_TOKEN // 2
    assert hybrid.capacity_line() == (
        f"KV cache: {hybrid.num_blocks} blocks x 16 tokens = {hybrid.num_tokens} tokens ({per_layer} bytes/token, "
        f"{hybrid.pool_bytes / 2**20:.1f} MiB, float32) on cpu; a block holds 1 of the model's 2 layers, in 2 KV "
        f"cache groups of {per_layer} B/token: group 0 full attention (layers 1); "
        f"group 1 sliding window 8, for their last 8 tokens (layers 0)"
    )
    # One group of every layer (the layout without the hybrid manager) plans as without groups.
    assert hybrid_plan(kv_group_layout([8, None], hybrid=False)) == one_group

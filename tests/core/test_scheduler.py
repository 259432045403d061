"""Scheduler behaviour without a model: budgets, admission, chunking, preemption."""

import pytest

from pagedllm.config.engine import SchedulerConfig
from pagedllm.core.block_moves import SwapIn, SwapOut
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import ModelRunnerOutput, SampledTokens
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, **config):
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), kv), kv


def make_request(rid, prompt_len, max_tokens=8, priority=0, prompt=None, cache_salt=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # Distinct prompts per id unless given, so the prefix cache stays out of the way.
    prompt = prompt or [1000 * (sum(map(ord, rid)) % 97) + i for i in range(1, prompt_len + 1)]
    return Request(rid, prompt, params, [EOS], max_tokens, priority=priority, cache_salt=cache_salt)


def runner_output(tokens: dict[str, list[int]], proposed: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
    """What a runner returns when sample row ``id`` got ``tokens[id]`` (logprobs 0)."""
    sampled = {sid: SampledTokens(list(ids), [0.0] * len(ids), [None] * len(ids)) for sid, ids in tokens.items()}
    return ModelRunnerOutput(sampled=sampled, proposed_draft_token_ids=proposed or {})


def run_step(scheduler, token=5):
    """Schedule, then pretend the model sampled `token` for every sampling row."""
    out = scheduler.schedule()
    sampled = {row.sequence_id: [token] for s in out.scheduled for row in s.sample_rows}
    scheduler.update_from_output(out, runner_output(sampled))
    scheduler.check_invariants()
    return out


def test_prefill_and_decode_share_a_step_and_requests_leave_when_done():
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=2))
    out = run_step(scheduler)
    assert [(s.sequence_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 10)]
    scheduler.add_request(make_request("b", 6, max_tokens=3))
    out = run_step(scheduler)  # a decodes its 2nd token, b prefills
    assert [(s.sequence_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    assert "a" not in scheduler.requests  # max_tokens=2 reached
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert kv.num_free_blocks == kv.num_blocks


def test_token_budget_and_max_num_seqs_bound_a_step():
    scheduler, _ = make_scheduler(max_num_batched_tokens=16, max_num_seqs=2, enable_chunked_prefill=False, max_model_len=16)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 6))
    out = scheduler.schedule()
    assert [s.sequence_id for s in out.scheduled] == ["a", "b"]  # 12 tokens, 2 seqs
    assert out.total_num_scheduled_tokens == 12
    assert scheduler.num_waiting == 1


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    scheduler, kv = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 20, max_tokens=1))
    chunks = []
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)
        chunks.append(out.scheduled[0].num_scheduled_tokens)
        if scheduler.has_unfinished_requests():
            # Blocks come in instalments: exactly what the computed tokens need.
            computed = scheduler.requests["a"].num_computed_tokens
            assert len(kv.get_block_ids("a")[0]) == -(-computed // 4)
    assert chunks == [8, 8, 4]


def test_preemption_recomputes_the_latest_arrival_and_nothing_leaks():
    # 4 blocks of 4 tokens: two requests of 6 prompt tokens fit (2 blocks each)
    # until both need a third block while decoding.
    scheduler, kv = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", 6, max_tokens=6))
    scheduler.add_request(make_request("b", 6, max_tokens=6))
    preempted = []
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)
        preempted += out.preempted_request_ids
    assert preempted and preempted[0] == "b"  # the later arrival is the victim
    assert scheduler.num_preemptions == len(preempted)
    assert kv.num_free_blocks == kv.num_blocks


def test_priority_policy_orders_admission_and_fcfs_ignores_priority():
    scheduler, _ = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    scheduler.add_request(make_request("low", 4, priority=5))
    scheduler.add_request(make_request("high", 4, priority=-1))
    assert [s.sequence_id for s in scheduler.schedule().scheduled] == ["high"]
    fcfs, _ = make_scheduler(max_num_seqs=1)
    fcfs.add_request(make_request("low", 4, priority=5))
    fcfs.add_request(make_request("high", 4, priority=-1))
    assert [s.sequence_id for s in fcfs.schedule().scheduled] == ["low"]


def test_a_strictly_more_urgent_arrival_takes_the_seat_and_equals_never_ping_pong():
    scheduler, kv = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    scheduler.add_request(make_request("low", 4, priority=5, max_tokens=20))
    run_step(scheduler)
    scheduler.add_request(make_request("same", 4, priority=5, max_tokens=2))
    out = run_step(scheduler)
    assert [s.sequence_id for s in out.scheduled] == ["low"] and not out.preempted_request_ids
    scheduler.add_request(make_request("urgent", 4, priority=0, max_tokens=2))
    out = run_step(scheduler)
    assert out.preempted_request_ids == ["low"]
    assert [s.sequence_id for s in out.scheduled] == ["urgent"]
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        run_step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_an_urgent_arrival_counts_the_blocks_of_every_kv_group():
    """Two groups (full attention, window 8): the urgent prompt's 3 blocks fit the free
    pool in one group but not in both, so the worst running request makes room."""
    kv = KVCacheManager(12, 4, windows=(None, 8))
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, scheduling_policy="priority"), kv)
    scheduler.add_request(make_request("low", 16, priority=5, max_tokens=20))
    run_step(scheduler)
    assert 3 <= kv.num_free_blocks < 6
    scheduler.add_request(make_request("urgent", 12, priority=0, max_tokens=2))
    out = run_step(scheduler)
    assert out.preempted_request_ids == ["low"]
    assert [s.sequence_id for s in out.scheduled] == ["urgent"]
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert kv.num_free_blocks == kv.num_blocks


def test_long_prefill_threshold_caps_each_chunk():
    scheduler, _ = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=30)
    scheduler.add_request(make_request("long", 70, max_tokens=1))
    scheduler.add_request(make_request("short", 10, max_tokens=1))
    out = run_step(scheduler)
    assert [(s.sequence_id, s.num_scheduled_tokens) for s in out.scheduled] == [("long", 30), ("short", 10)]


def test_a_chunk_never_ends_inside_an_image_the_model_attends_both_ways():
    """Gemma 3's rule (``Request.whole_spans``): a chunk stops before such an image, or takes it
    whole (past the long-prefill threshold) once the step's budget holds it; another model's image splits."""
    from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange

    def image_request(rid, both_ways):
        request = make_request(rid, 40, max_tokens=1)
        request.mm_features = (MultiModalFeature("image", rid, PlaceholderRange(8, 20), 7, 20, None, both_ways),)
        return request

    scheduler, _ = make_scheduler(max_num_batched_tokens=24, long_prefill_token_threshold=12)
    scheduler.add_request(image_request("gemma", True))
    scheduler.add_request(image_request("llava", False))
    chunks = [[(s.sequence_id, s.num_scheduled_tokens) for s in run_step(scheduler).scheduled] for _ in range(3)]
    # gemma: up to the image, then the image whole (20 > 12), then the rest; llava: what the budget leaves
    assert chunks == [[("gemma", 8), ("llava", 12)], [("gemma", 20), ("llava", 4)], [("gemma", 12), ("llava", 12)]]


def test_swap_mode_moves_private_blocks_to_host_and_back():
    kv = KVCacheManager(8, 4, num_swap_blocks=8)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, preemption_mode="swap"), kv)
    scheduler.add_request(make_request("a", 10, max_tokens=20))
    scheduler.add_request(make_request("b", 10, max_tokens=20))
    swapped_out = swapped_in = 0
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        out = run_step(scheduler)
        swapped_out += len(out.block_moves.of(SwapOut))
        swapped_in += len(out.block_moves.of(SwapIn))
        assert not (out.block_moves.of(SwapOut) and out.block_moves.of(SwapIn))  # never both in one step
    assert swapped_out > 0 and swapped_in == swapped_out
    assert scheduler.num_preemptions > 0 and scheduler.num_recomputed_tokens == 0
    assert kv.num_swap_out_blocks == kv.num_swap_in_blocks == swapped_out
    assert kv.num_free_blocks == kv.num_blocks and kv.swap_space.num_free_blocks == 8


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    kv = KVCacheManager(8, 4, num_swap_blocks=1)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, preemption_mode="swap"), kv)
    scheduler.add_request(make_request("a", 10, max_tokens=20))
    scheduler.add_request(make_request("b", 10, max_tokens=20))
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        run_step(scheduler)
    assert scheduler.num_recomputed_tokens > 0 and kv.num_swap_out_blocks == 0
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler, kv = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 9))
    scheduler.add_request(make_request("b", 9))
    run_step(scheduler)
    assert kv.num_free_blocks < kv.num_blocks
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)  # twice is harmless
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert scheduler.schedule().is_empty
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_request("a", RequestStatus.RUNNING)


def test_admission_reuses_cached_prefix_blocks_and_computes_the_rest():
    scheduler, kv = make_scheduler(block_size=4)
    shared = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    scheduler.add_request(make_request("a", 0, max_tokens=1, prompt=shared + [50, 51]))
    run_step(scheduler)
    assert kv.block_pool.num_cached_blocks == 3  # 12 computed tokens = 3 full blocks
    scheduler.add_request(make_request("b", 0, max_tokens=1, prompt=shared + [60]))
    out = run_step(scheduler)
    assert out.scheduled[0].num_scheduled_tokens == 3  # 8 cached, tokens 8..10 computed
    assert kv.stats().prefix_cache_hits == 8 and kv.stats().prefix_cache_queries == 12 + 11
    # A different salt shares nothing.
    scheduler.add_request(make_request("c", 0, max_tokens=1, prompt=shared + [60], cache_salt="tenant-2"))
    assert run_step(scheduler).scheduled[0].num_scheduled_tokens == 11
    # A fully cached prompt still computes its last block: there must be logits to sample.
    scheduler.add_request(make_request("d", 0, max_tokens=1, prompt=shared + [50, 51]))
    assert run_step(scheduler).scheduled[0].num_scheduled_tokens == 4
    assert kv.num_free_blocks == kv.num_blocks

"""The scheduler -> runner seam: plain step data, sample rows decided once, diffs,
one place for status changes, and the KV manager protocol."""

import dataclasses
import inspect

import pytest

from pagedllm.config.engine import SchedulerConfig
from pagedllm.core.contiguous import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_interface import KVCacheManagerProtocol, KVCacheStats
from pagedllm.core.request import Request, RequestStatus, child_request_id, child_seed
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.waiting_queue import WaitingQueue
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import make_request, make_scheduler, run_step, runner_output


def live_objects(value, seen=None):
    """Every object reachable through dataclass fields, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    yield value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        children = list(value)
    elif isinstance(value, dict):
        children = list(value.keys()) + list(value.values())
    else:
        children = []
    for child in children:
        yield from live_objects(child, seen)


def test_the_runner_gets_plain_data_and_never_a_request():
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=4))
    for _ in range(4):
        out = run_step(scheduler)
        assert not any(isinstance(obj, Request) for obj in live_objects(out))


def test_sample_rows_are_decided_once_and_the_forks_follow_them():
    scheduler, _ = make_scheduler()
    params = SamplingParams(n=3, temperature=1.0, max_tokens=3, ignore_eos=True)
    request = Request("g", list(range(1, 7)), params, [0], 3, seed=11, num_samples=3)
    scheduler.add_request(request)
    out = scheduler.schedule()
    rows = out.scheduled[0].sample_rows
    assert [r.sequence_id for r in rows] == ["g", "g::1", "g::2"]
    assert [r.seed for r in rows] == [child_seed(11, i) for i in range(3)]
    assert {r.output_position for r in rows} == {0}
    scheduler.update_from_output(out, runner_output({"g": [7], "g::1": [8], "g::2": [9]}))
    scheduler.check_invariants()
    samples = {rid: scheduler.requests[rid] for rid in ("g", "g::1", "g::2")}
    assert [s.output_token_ids for s in samples.values()] == [[7], [8], [9]]
    assert [s.seed for s in samples.values()] == [r.seed for r in rows]
    # From now on each sample has one row of its own, at the next position.
    out = scheduler.schedule()
    assert sorted((r.sequence_id, r.output_position) for s in out.scheduled for r in s.sample_rows) == [
        ("g", 1), ("g::1", 1), ("g::2", 1)]
    assert child_request_id("g", 2) == "g::2"


def test_running_sequences_are_sent_as_diffs_and_resent_whole_after_preemption():
    # 4 blocks of 4 tokens: "b" is preempted (recompute) when both need a third block.
    scheduler, _ = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", 6, max_tokens=6))
    scheduler.add_request(make_request("b", 6, max_tokens=6))
    first = run_step(scheduler, token=5)
    assert sorted(d.sequence_id for d in first.new_sequences) == ["a", "b"]
    assert all(not s.new_token_ids and not s.new_block_ids for s in first.scheduled)
    second = run_step(scheduler, token=6)
    assert not second.new_sequences
    assert [s.new_token_ids for s in second.scheduled] == [[5], [5]]  # the token sampled last step
    assert [s.new_block_ids for s in second.scheduled] == [[], []]  # token 7 still fits block 1
    seen_preemption = False
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler, token=6)
        if out.preempted_request_ids:
            seen_preemption = True
            assert set(out.preempted_request_ids) <= set(out.released_sequence_ids)
        for data in out.new_sequences:  # a resumed sequence comes back whole
            assert data.output_token_ids and all(t in (5, 6) for t in data.output_token_ids)
    assert seen_preemption


def test_every_status_change_keeps_the_counts_the_queue_and_the_seats():
    scheduler, kv = make_scheduler(max_num_seqs=2, num_blocks=6, block_size=4)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 5, max_tokens=8))
    assert (scheduler.num_waiting, scheduler.num_running) == (3, 0)
    run_step(scheduler)
    assert (scheduler.num_waiting, scheduler.num_running, scheduler.num_seats_in_use) == (1, 2, 2)
    scheduler.finish_request("c", RequestStatus.FINISHED_ABORTED)  # a waiting one
    assert scheduler.num_waiting == 0 and len(scheduler.waiting) == 0
    scheduler.check_invariants()
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert (scheduler.num_waiting, scheduler.num_running, scheduler.num_swapped, scheduler.num_seats_in_use) == (0, 0, 0, 0)
    assert kv.num_free_blocks == kv.num_blocks


def test_waiting_queue_ranks_discards_lazily_and_counts_live_entries():
    params = SamplingParams(max_tokens=1)
    requests = {rid: Request(rid, [1], params, [0], 1, priority=p) for rid, p in (("x", 3), ("y", 1), ("z", 2))}
    queue = WaitingQueue(lambda r: (r.priority,))
    for request in requests.values():
        queue.push(request)
    assert len(queue) == 3 and queue.peek() is requests["y"]
    queue.discard(requests["y"])
    queue.discard(requests["y"])  # twice is harmless
    assert len(queue) == 2 and queue.peek() is requests["z"] and requests["y"] not in queue
    queue.push(requests["y"])  # back in, with a fresh entry
    assert queue.peek() is requests["y"] and sorted(r.request_id for r in queue) == ["x", "y", "z"]
    with pytest.raises(ValueError, match="already waiting"):
        queue.push(requests["x"])


@pytest.mark.parametrize("manager", [KVCacheManager(8, 4), ContiguousKVCacheManager(8, 4, 16)])
def test_both_kv_managers_implement_the_whole_protocol(manager):
    wanted = {name for name, _ in inspect.getmembers(KVCacheManagerProtocol) if not name.startswith("_")}
    missing = {name for name in wanted if not hasattr(manager, name)}
    assert not missing
    for name in wanted:
        protocol_member = inspect.getattr_static(KVCacheManagerProtocol, name)
        if inspect.isfunction(protocol_member):
            ours = inspect.signature(getattr(manager, name))
            theirs = inspect.signature(protocol_member)
            assert list(ours.parameters) == list(theirs.parameters)[1:], name
    stats = manager.stats()
    assert isinstance(stats, KVCacheStats) and stats.num_blocks_in_use == 0 and stats.usage == 0.0


def test_a_scheduler_runs_on_the_contiguous_manager_through_the_protocol():
    kv = ContiguousKVCacheManager(16, 4, 32)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32), kv)
    for rid in "ab":
        scheduler.add_request(make_request(rid, 7, max_tokens=5))
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)
        for scheduled in out.scheduled:
            assert scheduled.new_block_ids == []  # the reservation is made whole at admission
    assert kv.stats().num_free_blocks == 16


def test_get_block_ids_from_an_entry_returns_only_the_tail():
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("a", 0, 10)
    table = kv.get_block_ids("a")[0]
    assert len(table) == 3 and kv.get_block_ids("a", 1)[0] == table[1:] and kv.get_block_ids("a", 3)[0] == []

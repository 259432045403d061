"""Speculative decoding in the scheduler, without a model: drafts ride in the
step's span, rejected ones are rolled back (computed tokens and the table's
tail), and the runner's mirrored tables follow the cut."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config.engine import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import runner_output

EOS = 0
K = 3


class MirroredRunner:
    """What a runner holds of each sequence, built only from the diffs."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}  # per KV cache group
        self.tokens: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for sequence_id in out.released_sequence_ids:
            self.tables.pop(sequence_id, None)
            self.tokens.pop(sequence_id, None)
        for data in out.new_sequences:
            self.tables[data.sequence_id] = [list(table) for table in data.block_ids]
            self.tokens[data.sequence_id] = data.prompt_token_ids + data.output_token_ids
        for s in out.scheduled:
            tables = self.tables[s.sequence_id]
            if s.truncated_table_length is not None:
                for table in tables:
                    del table[s.truncated_table_length :]
            for group, index, block_id in s.replaced_blocks:
                tables[group][index] = block_id
            for table, new in zip(tables, s.new_block_ids):
                table.extend(new)
            self.tokens[s.sequence_id] += s.new_token_ids


def make(num_blocks=64, block_size=4, prefix_caching=False, windows=(None,), **config):
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, windows=windows)
    return Scheduler(SchedulerConfig(num_speculative_tokens=K, **config), kv), kv


def kv_of(scheduler):
    return scheduler.kv_cache_manager


def request(rid, prompt, max_tokens=20):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, [EOS], max_tokens)


def step(scheduler, runner, accept, propose=lambda sid: [7] * K, token=5):
    """Schedule; accept ``accept(sid, drafts)`` drafts of each verifying sequence."""
    out = scheduler.schedule()
    runner.apply(out)
    for s in out.scheduled:  # the diffs rebuild the manager's table and the tokens exactly
        assert runner.tokens[s.sequence_id] == scheduler.requests[s.sequence_id].all_token_ids
        assert runner.tables[s.sequence_id] == kv_of(scheduler).get_block_ids(s.sequence_id)
    proposed, sampled = {}, {}
    for s in out.scheduled:
        for row in s.sample_rows:
            sampled[row.sequence_id] = [token]
        if s.draft_token_ids:  # one list per row: the accepted drafts, then the closing token
            sampled[s.sequence_id] = s.draft_token_ids[: accept(s.sequence_id, s.draft_token_ids)] + [token]
        if s.num_draft_tokens and s.sample_rows:
            proposed[s.sequence_id] = propose(s.sequence_id)[: s.num_draft_tokens]
    scheduler.update_from_output(out, runner_output(sampled, proposed))
    scheduler.check_invariants()
    return out


def test_drafts_ride_in_the_span_and_a_rejection_frees_the_tail():
    scheduler, kv = make()
    runner = MirroredRunner()
    scheduler.add_request(request("a", [1, 2, 3, 4, 5, 6, 7]))  # 7 tokens: blocks of 4
    out = step(scheduler, runner, accept=lambda sid, d: 0)
    assert out.scheduled[0].num_scheduled_tokens == 7 and out.scheduled[0].num_draft_tokens == K
    req = scheduler.requests["a"]
    assert req.draft_token_ids == [7] * K and req.num_tokens == 8
    free_before = kv.num_free_blocks
    out = step(scheduler, runner, accept=lambda sid, d: 0)
    (s,) = out.scheduled
    # The last known token then 3 drafts: positions 7..10 need a third block.
    assert (s.num_computed_tokens, s.num_scheduled_tokens, s.draft_token_ids) == (7, 4, [7, 7, 7])
    assert free_before - len(s.new_block_ids[0]) == kv.num_free_blocks - 1  # the third block went back
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert len(kv.get_block_ids("a")[0]) == 2
    out = step(scheduler, runner, accept=lambda sid, d: len(d))
    assert out.scheduled[0].truncated_table_length == 2  # the runner hears of the cut
    assert runner.tables["a"] == kv.get_block_ids("a")
    # All three accepted plus the closing token: four tokens in one step.
    assert req.num_tokens == 13 and req.num_computed_tokens == 12


def test_a_step_the_runner_proposes_nothing_for_carries_no_drafts():
    """A step's drafts are spent once verified: a sequence the runner proposes
    nothing for (no match, or drafts withheld) decodes one token next step."""
    scheduler, _ = make()
    runner = MirroredRunner()
    scheduler.add_request(request("a", [1, 2, 3, 4, 5]))
    step(scheduler, runner, accept=lambda sid, d: 0)  # prefill; proposes [7, 7, 7]
    out = step(scheduler, runner, accept=lambda sid, d: 1, propose=lambda sid: [])
    assert out.scheduled[0].draft_token_ids == [7, 7, 7]
    assert scheduler.requests["a"].draft_token_ids == []
    out = step(scheduler, runner, accept=lambda sid, d: 0, propose=lambda sid: [])
    (s,) = out.scheduled
    assert s.draft_token_ids == [] and s.num_scheduled_tokens == 1


def test_drafts_stop_at_max_tokens_and_are_cut_by_the_budget():
    scheduler, kv = make(max_num_batched_tokens=3)
    runner = MirroredRunner()
    scheduler.add_request(request("a", [1, 2], max_tokens=4))
    step(scheduler, runner, accept=lambda sid, d: len(d))
    out = step(scheduler, runner, accept=lambda sid, d: len(d))
    # Budget 3: the last token and two drafts (the third is dropped).
    assert out.scheduled[0].draft_token_ids == [7, 7]
    req = scheduler.requests.get("a")
    assert req is None  # 1 + 2 accepted + closing = 4 = max_tokens: finished
    assert kv.num_free_blocks == kv.num_blocks


def test_draft_room_leaves_space_for_the_closing_token():
    scheduler, kv = make()
    runner = MirroredRunner()
    scheduler.add_request(request("a", [1, 2], max_tokens=3))
    step(scheduler, runner, accept=lambda sid, d: len(d))
    assert scheduler.requests["a"].draft_token_ids == [7]  # 1 output so far: room for 1 draft + closing
    step(scheduler, runner, accept=lambda sid, d: len(d))
    assert "a" not in scheduler.requests and kv.num_free_blocks == kv.num_blocks


def test_blocks_holding_drafts_are_never_cached():
    scheduler, kv = make(prefix_caching=True)
    runner = MirroredRunner()
    scheduler.add_request(request("a", [1, 2, 3]))
    step(scheduler, runner, accept=lambda sid, d: 0)
    step(scheduler, runner, accept=lambda sid, d: 0)  # positions 3..6 written: block 1 full of drafts
    blocks = kv.groups[0].tables["a"].entries
    assert blocks[0].block_hash is not None and len(blocks) == 1


def test_a_preempted_sequence_drops_its_drafts():
    scheduler, kv = make(num_blocks=6)
    runner = MirroredRunner()
    scheduler.add_request(request("a", list(range(1, 9)), max_tokens=12))
    scheduler.add_request(request("b", list(range(20, 28)), max_tokens=12))
    preempted = False
    while scheduler.has_unfinished_requests():
        out = step(scheduler, runner, accept=lambda sid, d: 1)
        for rid in out.preempted_request_ids:
            preempted = True
            assert scheduler.requests[rid].draft_token_ids == []
    assert preempted and kv.num_free_blocks == kv.num_blocks


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.integers(6, 24), st.sampled_from([(None,), (None, 6, 6)]))
def test_random_acceptance_keeps_every_table_consistent(seed, prefix_caching, num_blocks, windows):
    """The runner's mirrored tables (every group's, one or a hybrid layout:
    released entries, copies on write, cuts) follow the manager's through
    random drafts and acceptances."""
    rng = random.Random(seed)
    # A step takes a block in every group: the pool grows with them, so the same requests fit.
    scheduler, kv = make(num_blocks=num_blocks * len(windows), prefix_caching=prefix_caching,
                         max_num_batched_tokens=12, windows=windows)
    runner = MirroredRunner()
    shared = [rng.randrange(1, 50) for _ in range(5)]
    for i in range(4):
        prompt = shared + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        scheduler.add_request(request(f"r{i}", prompt, max_tokens=rng.randrange(1, 15)))
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner, accept=lambda sid, d: rng.randrange(len(d) + 1),
             propose=lambda sid: [rng.randrange(1, 50) for _ in range(K)])
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks

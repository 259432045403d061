"""The runner -> scheduler seam: one token list per sample row (the scheduler
learns accepted drafts from its length), and the sequence-group policy whose
decisions the scheduler carries out. Core itself knows no beam search."""

from __future__ import annotations

import io
import tokenize
from collections.abc import Mapping
from pathlib import Path

import pytest

import pagedllm.core
from pagedllm.config.engine import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SampleRow
from pagedllm.core.sequence_group import SAMPLING, Append, Decision, Finish, Fork, SamplingPolicy
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import runner_output

EOS = 0
K = 3


def make(num_speculative_tokens=K, **config):
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(64, 4)
    return Scheduler(SchedulerConfig(num_speculative_tokens=num_speculative_tokens, **config), kv), kv


def request(rid, prompt, max_tokens=20, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, [EOS], max_tokens, **kwargs)


def step(scheduler, tokens, proposed=None):
    out = scheduler.schedule()
    advanced = scheduler.update_from_output(out, runner_output(tokens, proposed))
    scheduler.check_invariants()
    return out, advanced


def prefill_with_drafts(scheduler):
    """A 5-token prompt prefilled; the runner proposed [7, 7, 7] for the next step."""
    scheduler.add_request(request("a", [1, 2, 3, 4, 5]))
    step(scheduler, {"a": [5]}, {"a": [7, 7, 7]})
    req = scheduler.requests["a"]
    assert (req.num_tokens, req.num_computed_tokens, req.draft_token_ids) == (6, 5, [7, 7, 7])
    return req


def test_a_list_of_k_plus_one_tokens_accepts_k_drafts():
    scheduler, kv = make()
    req = prefill_with_drafts(scheduler)
    out, advanced = step(scheduler, {"a": [7, 7, 9]})  # two drafts accepted, then the runner's own token
    (scheduled,) = out.scheduled
    assert (scheduled.num_scheduled_tokens, scheduled.draft_token_ids) == (4, [7, 7, 7])
    assert advanced == [req]
    assert req.output_token_ids == [5, 7, 7, 9]
    assert req.num_computed_tokens == 8  # 5 + 4 scheduled - 1 rejected draft
    assert len(kv.get_block_ids("a")[0]) == 2  # positions 0..7: the block of the rejected one went back


def test_a_one_token_list_rejects_every_draft():
    scheduler, _ = make()
    req = prefill_with_drafts(scheduler)
    step(scheduler, {"a": [9]})
    assert req.output_token_ids == [5, 9] and req.num_computed_tokens == 6


@pytest.mark.parametrize("tokens", [[8, 9], [7, 8, 9, 7, 1]])
def test_a_list_whose_accepted_part_is_not_the_drafts_is_a_runner_bug(tokens):
    scheduler, _ = make()
    prefill_with_drafts(scheduler)
    out = scheduler.schedule()
    with pytest.raises(RuntimeError, match="not a prefix of the drafts"):
        scheduler.update_from_output(out, runner_output({"a": tokens}))


def test_a_sequence_without_drafts_gets_exactly_one_token():
    scheduler, _ = make(num_speculative_tokens=0)
    scheduler.add_request(request("a", [1, 2, 3]))
    out = scheduler.schedule()
    with pytest.raises(RuntimeError, match="not a prefix of the drafts"):
        scheduler.update_from_output(out, runner_output({"a": [4, 5]}))


class CopyThenDrop:
    """A toy policy: at the first sampled position it forks the request once
    (the copy gets the sampled token + 1), and the next time the request samples
    it finishes the copy. Never swapped, never speculates."""

    may_swap = False
    may_speculate = False

    def __init__(self) -> None:
        self.calls = 0

    def num_rows(self, request: Request) -> int:
        return 1

    def decide(self, request: Request, rows: list[SampleRow], sampled: Mapping[str, SampledTokens]) -> list[Decision]:
        self.calls += 1
        (token,) = sampled[request.request_id].token_ids
        if self.calls == 1:
            copy = f"{request.request_id}::copy"
            return [Fork(request.request_id, copy, 1, 99), Append(request.request_id, [token]), Append(copy, [token + 1])]
        return [Append(request.request_id, [token]), Finish(f"{request.request_id}::copy", RequestStatus.FINISHED_STOPPED)]


def test_the_scheduler_carries_out_a_policy_s_forks_appends_and_finishes():
    scheduler, kv = make()
    policy = CopyThenDrop()
    scheduler.add_request(request("g", [1, 2, 3, 4, 5, 6], num_samples=2, group_policy=policy))
    out = scheduler.schedule()
    assert scheduler.num_seats_in_use == 2  # admission reserves the places its group will take
    advanced = scheduler.update_from_output(out, runner_output({"g": [40]}))
    scheduler.check_invariants()
    assert [len(s.sample_rows) for s in out.scheduled] == [1]
    assert not any(s.num_draft_tokens for s in out.scheduled)  # may_speculate is False
    copy = scheduler.requests["g::copy"]
    assert advanced == [scheduler.requests["g"]]  # one sequence per sample row
    assert (copy.output_token_ids, copy.seed, copy.sample_index) == ([41], 99, 1)
    assert copy.group_policy is policy  # forks share their request's policy
    assert kv.get_block_ids("g::copy")[0][0] == kv.get_block_ids("g")[0][0]  # the prompt's full block is shared
    assert scheduler.num_seats_in_use == 2
    out, _ = step(scheduler, {"g": [42], "g::copy": [43]})
    assert "g::copy" not in scheduler.requests and scheduler.requests["g"].output_token_ids == [40, 42]
    assert scheduler.num_seats_in_use == 1
    scheduler.finish_request("g", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_blocks


class SampleWithoutSwapping(SamplingPolicy):
    may_swap = False


@pytest.mark.parametrize("policy, status", [(SAMPLING, RequestStatus.SWAPPED),
                                            (SampleWithoutSwapping(), RequestStatus.PREEMPTED)])
def test_a_policy_that_may_not_swap_is_recomputed(policy, status):
    # 4 blocks of 4 tokens: "b" (the latest arrival) is preempted when both need a third block.
    kv = KVCacheManager(4, 4, num_swap_blocks=8)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, preemption_mode="swap"), kv)
    scheduler.add_request(request("a", list(range(1, 7)), max_tokens=8))
    scheduler.add_request(request("b", list(range(11, 17)), max_tokens=8, group_policy=policy))
    for _ in range(4):
        out = scheduler.schedule()
        if out.preempted_request_ids:
            assert [(rid, scheduler.requests[rid].status) for rid in out.preempted_request_ids] == [("b", status)]
            return
        tokens = {row.sequence_id: [5] for s in out.scheduled for row in s.sample_rows}
        scheduler.update_from_output(out, runner_output(tokens))
    pytest.fail("no preemption")


def test_sampling_is_every_request_s_default_policy():
    req = request("a", [1, 2, 3])
    assert req.group_policy is SAMPLING and SAMPLING.may_swap and SAMPLING.may_speculate
    rows = [SampleRow("a", 1, 0), SampleRow("a::1", 2, 0)]
    tokens = {"a": SampledTokens([4], [0.0], [None]), "a::1": SampledTokens([6], [0.0], [None])}
    assert SAMPLING.decide(req, rows, tokens) == [Fork("a", "a::1", 1, 2), Append("a", [4]), Append("a::1", [6])]


def test_core_knows_no_beam_search():
    """Beam search is a policy outside core: no core name mentions beams, and
    a request has no mode flag for it."""
    assert not hasattr(request("a", [1]), "tokens_chosen_externally")
    core = Path(pagedllm.core.__file__).parent
    for path in sorted(core.glob("*.py")):
        source = path.read_text()
        names = {t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME}
        assert not [name for name in names if "beam" in name.lower()], path.name
        assert "pagedllm.engine" not in source, path.name


def test_a_pooling_request_ends_at_its_last_prompt_token_with_the_runners_pooled_output():
    from pagedllm.core.runner_output import ModelRunnerOutput, PooledOutput
    from pagedllm.core.sequence_group import POOLING
    from pagedllm.pooling_params import PoolingParams

    scheduler, kv = make(num_speculative_tokens=0, max_num_batched_tokens=4, long_prefill_token_threshold=4)
    pooling = PoolingParams(task="embed")
    req = Request("p", list(range(1, 11)), SamplingParams(max_tokens=1), [EOS], 1, group_policy=POOLING,
                  pooling_params=pooling)
    scheduler.add_request(req)
    pooled = PooledOutput(b"\x00\x00\x80\x3f", (1,))
    rows = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        (scheduled,) = out.scheduled
        rows.append(len(scheduled.sample_rows))
        if out.new_sequences:
            assert out.new_sequences[0].pooling_params == pooling  # the runner learns it pools this one
        done = ModelRunnerOutput(pooled={"p": pooled}) if scheduled.sample_rows else ModelRunnerOutput()
        advanced = scheduler.update_from_output(out, done)
        scheduler.check_invariants()
    assert rows == [0, 0, 1]  # chunks of 4, 4 and 2 tokens: only the last one is pooled
    assert advanced == [req] and req.pooled == pooled and req.output_token_ids == []
    assert req.status is RequestStatus.FINISHED_STOPPED and kv.num_free_blocks == kv.num_blocks
    assert not POOLING.may_swap and not POOLING.may_speculate

"""Stateful fuzzing of the whole engine on a tiny model and a tiny pool.

Hypothesis drives random sequences of: add a request (random lengths, n, seeds,
stop strings, priorities, shared prefixes, salts, beam search), step, abort.
The pool is small enough that preemption (recompute and swap), prefix-cache
eviction and copy-on-write all happen. ``debug_invariants=True`` checks every
block-manager invariant after each step, and the machine checks them after
every rule too. At teardown the engine drains: every request that was not
aborted finished with a valid finish_reason, the pool is all-free, and each
greedy request produced the same tokens as when run alone.

``PAGEDLLM_FUZZ_EXAMPLES`` raises the number of examples for a longer run by
hand (CI uses a bounded profile that finishes in well under 3 minutes).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from tests.conftest import assert_pool_free

FINISH_REASONS = {"stop", "length"}
SHARED_PREFIX = list(range(300, 340))  # 40 tokens: 10 full blocks of 4
MAX_LIVE = 6

tokens = st.lists(st.integers(min_value=5, max_value=2000), min_size=1, max_size=30)


def make_machine(make_llm):
    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # A fresh engine per example, so a failing example cannot leave
            # state behind that changes the next one (or its shrinking).
            self.llm = make_llm()
            self.engine = self.llm.llm_engine
            self.counter = 0
            self.live: dict[str, dict] = {}  # request id -> what was asked
            self.finished: dict[str, list] = {}  # request id -> final completions
            self.aborted: set[str] = set()

        def _new_id(self) -> str:
            self.counter += 1
            return f"fuzz-{self.counter}"

        @precondition(lambda self: len(self.live) < MAX_LIVE)
        @rule(
            own=tokens,
            shared=st.booleans(),
            max_tokens=st.integers(1, 24),
            n=st.sampled_from([1, 1, 2, 3]),
            temperature=st.sampled_from([0.0, 0.0, 0.8]),
            seed=st.one_of(st.none(), st.integers(0, 2**31)),
            stop=st.sampled_from([[], ["e"], ["the", "a"]]),
            priority=st.integers(-2, 2),
            salt=st.sampled_from([None, None, "tenant-a", "tenant-b"]),
        )
        def add_request(self, own, shared, max_tokens, n, temperature, seed, stop, priority, salt):
            prompt = (SHARED_PREFIX if shared else []) + own
            params = SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, stop=stop)
            request_id = self._new_id()
            self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params, priority=priority, cache_salt=salt)
            self.live[request_id] = {"prompt": prompt, "params": params, "salt": salt, "beam": False}

        @precondition(lambda self: len(self.live) < MAX_LIVE)
        @rule(own=tokens, beam_width=st.integers(2, 3), max_tokens=st.integers(1, 10), priority=st.integers(-2, 2))
        def add_beam_request(self, own, beam_width, max_tokens, priority):
            request_id = self._new_id()
            params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens)
            self.engine.add_beam_request(request_id, {"prompt_token_ids": own}, params, priority=priority)
            self.live[request_id] = {"prompt": own, "params": params, "beam": True}

        @rule(steps=st.integers(1, 6))
        def step(self, steps):
            for _ in range(steps):
                self._collect(self.engine.step())

        @precondition(lambda self: bool(self.live))
        @rule(data=st.data())
        def abort(self, data):
            request_id = data.draw(st.sampled_from(sorted(self.live)))
            self.engine.abort_request(request_id)
            del self.live[request_id]
            self.aborted.add(request_id)

        @invariant()
        def blocks_are_consistent(self):
            self.engine.check_invariants()

        def _collect(self, outputs) -> None:
            for output in outputs:
                if output.finished and output.request_id in self.live:
                    self.finished[output.request_id] = output.outputs
                    for completion in output.outputs:
                        assert completion.finish_reason in FINISH_REASONS, completion

        def teardown(self) -> None:
            for _ in range(2000):
                if not self.engine.has_unfinished_requests():
                    break
                self._collect(self.engine.step())
            assert not self.engine.has_unfinished_requests(), "the engine did not drain"
            assert set(self.finished) == set(self.live), "a request that was not aborted never finished"
            # Greedy single-sequence requests: the same tokens as when run alone.
            alone = {rid: asked for rid, asked in self.live.items()
                     if not asked["beam"] and asked["params"].temperature == 0.0 and asked["params"].n == 1}
            for request_id, asked in alone.items():
                solo = self.llm.generate([{"prompt_token_ids": asked["prompt"]}], asked["params"], use_tqdm=False)[0]
                assert self.finished[request_id][0].token_ids == solo.outputs[0].token_ids, request_id
            assert_pool_free(self.llm)

    return EngineMachine


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_engine_survives_random_workloads(tiny_model_dir, preemption_mode):
    folder = tiny_model_dir("llama")

    def make_llm() -> LLM:
        return LLM(
            folder,
            block_size=4,
            num_kv_blocks=40,  # a few requests fill it: preemption, eviction and copy-on-write all fire
            max_num_seqs=6,
            max_num_batched_tokens=64,
            preemption_mode=preemption_mode,
            swap_space=0.001,
            scheduling_policy="priority",
            debug_invariants=True,
            seed=0,
        )

    examples = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "25"))
    run_state_machine_as_test(
        make_machine(make_llm),
        settings=settings(max_examples=examples, stateful_step_count=25, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )

"""async_scheduling: the next step's forward runs on the runner thread while
this step's outputs are built. Outputs are exactly the synchronous engine's
(every feature whose state feeds the next schedule is applied first), a
failing forward aborts only its requests, and the pool ends free."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.conftest import assert_pool_free
from tests.engine.test_speculative import NGRAM, repetitive_prompts, token_ids

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def mixed_params(stop: str) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.9, max_tokens=20, n=3, seed=4),
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=30, seed=9, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def outputs_of(llm: LLM, prompts, params) -> list:
    outputs = llm.generate(prompts, params)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("speculative", [None, NGRAM])
def test_outputs_equal_the_synchronous_engine(tiny_llama, speculative):
    prompts = repetitive_prompts(6, seed=7)
    sync = LLM(tiny_llama, num_kv_blocks=256, speculative_config=speculative)
    probe = sync.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    params = mixed_params(probe[0].outputs[0].text[8:12])
    expected = outputs_of(sync, prompts, params)
    overlapped = LLM(tiny_llama, num_kv_blocks=256, speculative_config=speculative, async_scheduling=True,
                     debug_invariants=True)
    assert outputs_of(overlapped, prompts, params) == expected
    assert expected[0][0][3] is not None  # the stop string was met, so a dropped token was exercised
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    assert [b.sequences[0].tokens for b in overlapped.beam_search(prompts[:2], beams)] == \
        [b.sequences[0].tokens for b in sync.beam_search(prompts[:2], beams)]
    assert_pool_free(overlapped)
    assert_pool_free(sync)


def test_preemption_and_aborts_with_a_step_in_flight(tiny_llama):
    prompts = repetitive_prompts(12, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = token_ids(LLM(tiny_llama, num_kv_blocks=256).generate(prompts, params))
    llm = LLM(tiny_llama, num_kv_blocks=24, async_scheduling=True, debug_invariants=True)
    assert token_ids(llm.generate(prompts, params)) == expected
    assert llm.stats()["num_preemptions"] > 0
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"abort-{i}", prompt, params)
    engine.step()
    engine.step()
    engine.abort_request(["abort-0", "abort-2"])  # while the next step runs on the runner thread
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"abort-1", "abort-3"}
    assert_pool_free(llm)


def test_a_failing_forward_aborts_its_requests_and_the_engine_goes_on(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, num_kv_blocks=128, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("doomed", {"prompt_token_ids": [5, 6, 7]}, params)
    original = engine.runner.execute

    def fail(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.runner, "execute", original)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert len(out[0].outputs[0].token_ids) == 8
    assert_pool_free(llm)

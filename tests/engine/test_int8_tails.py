"""The engine with int8 KV and full-precision tails (issue 23): results depend
on positions only, never on chunking, batching, prefix caching, forks,
speculation or preemption; the tails (runs of the pool's own blocks, taken as
a sequence writes: issue 55) all come back; a pool too small for tails to pay
runs without them (issue 55: every key read as int8). The reading rule
itself is tests/attention/test_kv_tail_reads.py; SmolLM2's agreement with fp32
KV is tests/differential/test_kv_quant.py.

The tiny random model's greedy tokens hardly depend on the tails, so each run
is compared by its tokens and its cumulative logprobs: those move by 0.01-2
when the tails are off, by ~1e-5 between chunkings."""

from __future__ import annotations

import logging

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from tests.conftest import assert_pool_free
from tests.engine.test_engine_behaviour import token_prompts
from tests.engine.test_speculative import NGRAM

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
TOLERANCE = 1e-3  # on a cumulative logprob of ~-160 over 30 tokens


def int8_llm(tiny_llama, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 600)
    return LLM(tiny_llama, kv_cache_dtype="int8", debug_invariants=True, **kwargs)


def assert_tails_free(llm: LLM) -> None:
    """After the run: the pool is free, tails' blocks included, and the runner,
    once it hears of the last tails given back (the next step's output would
    carry them), holds none, uses none, and never lacked one."""
    assert_pool_free(llm)
    assert not llm.llm_engine.kv_cache_manager.tails.held
    tails = llm.llm_engine.runner.tail_slots
    tails.update_held(*llm.llm_engine.kv_cache_manager.take_tail_changes())
    tails.release_all_but([])
    assert not tails.held and not tails.block_of and tails.num_free == 0 and tails.num_refused == 0


def results(outputs) -> list[tuple[list[int], float]]:
    """(token ids, cumulative logprob) of each request's first completion."""
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outputs]


def assert_same(got, expected) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert a == pytest.approx(b, abs=TOLERANCE)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """6 prompts (lengths 37-42: partial blocks), whole prefills."""
    llm = int8_llm(tiny_llama)
    out = results(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    assert llm.llm_engine.pool_plan.tails_per_request == 1  # no speculation
    assert_tails_free(llm)
    return out


def _prompts():
    return [{"prompt_token_ids": p["prompt_token_ids"][: 37 + i]} for i, p in enumerate(token_prompts(6, 42))]


def test_tails_change_what_int8_reads(tiny_llama, expected):
    """Without tail bookkeeping the same int8 engine reads every key from the
    pool: the logprobs move well past the tolerance, so the tests below would
    see a tail that was lost or stale."""
    llm = int8_llm(tiny_llama)
    llm.llm_engine.runner.tail_slots = None
    got = results(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected)) > 20 * TOLERANCE


@pytest.mark.parametrize("kwargs", [
    dict(max_num_batched_tokens=7),  # chunks that start and end mid-block
    dict(max_num_batched_tokens=16),
    dict(max_num_seqs=2),  # other batches
    dict(num_kv_blocks=14),  # recompute preemption
], ids=["chunks of 7", "chunks of 16", "2 at a time", "recompute preemption"])
def test_chunking_batching_and_preemption_change_nothing(tiny_llama, expected, kwargs):
    llm = int8_llm(tiny_llama, **kwargs)
    assert_same(results(llm.generate(_prompts(), GREEDY, use_tqdm=False)), expected)
    if "num_kv_blocks" in kwargs:
        assert llm.stats()["num_preemptions"] > 0
    assert_tails_free(llm)


@pytest.mark.parametrize(("kv_cache_memory", "num_at_once"), [(64 * 2**10, None), (160 * 2**10, 6)],
                         ids=["64 KiB", "160 KiB"])
def test_a_budget_runs_as_many_sequences_as_its_blocks_hold(tiny_llama, expected, kv_cache_memory, num_at_once):
    """No cap on sequences: each takes its tail (4 blocks) from the pool as it starts.
    At 64 KiB (25 blocks) two fit at a time, and the others wait or are preempted
    like any block shortage; at 160 KiB (64 blocks) all 6 run at once, each with
    its tail. Either way the results are the whole-prefill run's."""
    llm = int8_llm(tiny_llama, num_kv_blocks=None, kv_cache_memory=kv_cache_memory)
    engine = llm.llm_engine
    assert engine.scheduler_config.max_num_seqs == 256
    assert_same(results(llm.generate(_prompts(), GREEDY, use_tqdm=False)), expected)
    if num_at_once is not None:
        assert llm.stats()["peak_running_per_step"] == num_at_once
    assert_tails_free(llm)


def test_swap_preemption_changes_nothing(tiny_llama, expected):
    llm = int8_llm(tiny_llama, num_kv_blocks=14, preemption_mode="swap")
    assert_same(results(llm.generate(_prompts(), GREEDY, use_tqdm=False)), expected)
    assert llm.stats()["swap_out_blocks"] > 0
    assert_tails_free(llm)


def test_prefix_cache_hit_reads_what_a_recompute_reads(tiny_llama):
    prefix = token_prompts(1, 40)[0]["prompt_token_ids"]  # 2 full blocks + 8 tokens
    prompts = [{"prompt_token_ids": prefix + [900 + i] * (1 + i)} for i in range(3)]
    cached = int8_llm(tiny_llama)
    cached.generate(prompts[0], GREEDY, use_tqdm=False)
    hits = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 32 for o in hits)
    fresh = int8_llm(tiny_llama, enable_prefix_caching=False)
    assert_same(results(hits), results(fresh.generate(prompts[1:], GREEDY, use_tqdm=False)))
    # A full hit (a prompt of whole blocks) recomputes its last block.
    whole = {"prompt_token_ids": prefix[:32]}
    again = cached.generate([whole, whole], GREEDY, use_tqdm=False)
    assert again[1].num_cached_tokens == 16
    assert_same(results(again), results(fresh.generate([whole, whole], GREEDY, use_tqdm=False)))
    assert_tails_free(cached)
    assert_tails_free(fresh)


def test_forked_samples_copy_their_parents_tail(tiny_llama, expected):
    """n=3 greedy samples fork mid-block after the prompt: every child must read
    the parent's tail (a copy-on-write copy of the partial block carries it)."""
    llm = int8_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3, logprobs=0)
    out = llm.generate(_prompts(), params, use_tqdm=False)
    for o, (tokens, logprob) in zip(out, expected):
        for child in o.outputs:
            assert list(child.token_ids) == tokens and child.cumulative_logprob == pytest.approx(logprob, abs=TOLERANCE)
    assert_tails_free(llm)


def test_beam_search_with_shared_and_copied_blocks_agree(tiny_llama):
    prompt = {"prompt_token_ids": [(17 * j) % 3000 + 300 for j in range(403)]}
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    shared = int8_llm(tiny_llama, num_kv_blocks=200)
    out = shared.beam_search([prompt], params)[0]
    copied = int8_llm(tiny_llama, num_kv_blocks=200, enable_block_sharing=False)
    other = copied.beam_search([prompt], params)[0]
    assert [s.tokens for s in other.sequences] == [s.tokens for s in out.sequences]
    assert [s.cum_logprob for s in other.sequences] == pytest.approx([s.cum_logprob for s in out.sequences],
                                                                     abs=TOLERANCE)
    assert_tails_free(shared)
    assert_tails_free(copied)


def test_ngram_speculation_gives_the_same_greedy_tokens(tiny_llama, expected):
    """Drafts fill and cross blocks, then roll back: the tail of the block the
    committed tokens end in must survive."""
    llm = int8_llm(tiny_llama, speculative_config=NGRAM)
    assert_same(results(llm.generate(_prompts(), GREEDY, use_tqdm=False)), expected)
    assert llm.stats()["spec_num_draft_tokens"] > 0
    assert llm.llm_engine.pool_plan.tails_per_request == 2  # one more for the drafts past a block
    assert_tails_free(llm)


def test_capacity_line_reports_the_tails(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = int8_llm(tiny_llama, max_num_seqs=8)
    # An fp32 value is 4 int8 ones: a tail takes 4 blocks' bytes.
    assert llm.llm_engine.pool_plan.tail_run_blocks == 4
    assert any("; a writing sequence also keeps its still-filling blocks in float32, in tails of 4 of these blocks "
               "(1 per sequence)" in r.getMessage() for r in caplog.records)


# The tiny Llama's fp32 block: 16 tokens x 512 bytes = 8 KiB; int8 blocks are 2,560 bytes, so 3 of them.
ONE_FP32_BLOCK = 8 * 2**10
# 2 prompts of 13 tokens and 12 generated: 2 blocks each, so at 3 blocks they cannot both finish at once.
SMALL_PROMPTS = token_prompts(2, 13, offset=5)


def short(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, n=n)


def assert_no_tails(llm: LLM) -> None:
    """The pool is free, and the engine kept no tails anywhere (plan, KV manager, runner)."""
    assert_pool_free(llm)
    engine = llm.llm_engine
    assert engine.pool_plan.tail_run_blocks == engine.kv_cache_manager.tails.blocks_per_request == 0
    assert not engine.kv_cache_manager.tails.held and engine.runner.tail_slots is None


@pytest.fixture(scope="module")
def without_tails(tiny_llama):
    """The oracle for a pool too small for tails: the same int8 engine reading
    every key as int8, on a roomy pool (600 blocks, both requests at once) whose
    plan is made to keep no tails."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pagedllm.worker.memory.tails_pay", lambda *args: False)
        llm = int8_llm(tiny_llama)
    out = results(llm.generate(SMALL_PROMPTS, short(), use_tqdm=False))
    assert_no_tails(llm)
    return out


@pytest.mark.parametrize(("kwargs", "n"), [
    (dict(), 1),
    pytest.param(dict(preemption_mode="swap", swap_space=0.001), 1, marks=pytest.mark.slow),
    pytest.param(dict(speculative_config=NGRAM), 1, marks=pytest.mark.slow),
    pytest.param(dict(), 2, marks=pytest.mark.slow),
], ids=["recompute preemption", "swap preemption", "ngram speculation", "n=2 forks"])
def test_one_fp32_blocks_budget_runs_int8_without_tails(tiny_llama, without_tails, kwargs, n, caplog):
    """Issue 55: one fp32 block of memory is 3 int8 blocks, too few for a block and
    its 4-block tail, so the plan keeps no tails (and says so) and int8 still runs
    (fp32 would hold 16 tokens): the tokens are the roomy tail-less engine's,
    whatever preemption, speculation or a fork (children read the parent's int8
    block as stored, no tail to copy) does."""
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = int8_llm(tiny_llama, num_kv_blocks=None, kv_cache_memory=ONE_FP32_BLOCK, **kwargs)
    assert llm.llm_engine.pool_plan.num_blocks == 3
    assert any("no full-precision tails: the pool is too small for them to pay" in r.getMessage()
               for r in caplog.records)
    out = llm.generate(SMALL_PROMPTS, short(n), use_tqdm=False)
    for child in range(n):
        got = [(list(o.outputs[child].token_ids), o.outputs[child].cumulative_logprob) for o in out]
        assert_same(got, without_tails)
    assert llm.stats()["num_preemptions"] > 0
    assert_no_tails(llm)

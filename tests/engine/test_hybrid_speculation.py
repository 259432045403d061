"""Speculative decoding with a draft model on a hybrid KV layout (several KV cache groups).

The draft is its own model with its own layers, so it follows one of the target's tables:
group 0's, the full-attention group's, which has an entry for every block (a sliding
group's table reads ``NULL_BLOCK_ID`` behind its window). Its pool covers every block id of
the shared pool, so whichever block group 0 gets, the draft has room for it. A rollback
cuts every group's table (``KVCacheManager.truncate``).

Tiny random Gemma 3 (5 local layers of window 8 to 1 global: 6 groups of one layer),
4-token blocks, prompts of 5 to 9 windows: greedy output equals Hugging Face's and the
same engine's without speculation, a draft that is the target itself is (nearly) always
right, which holds only if its K/V follows group 0 through prefix hits, rollbacks and
preemption; the pool is all-free after each test.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.conftest import assert_pool_free
from tests.engine.test_hybrid_kv_oracle import NEW_TOKENS, check_hybrid_oracle
from tests.engine.test_sliding_window import greedy, hf_greedy, prompts

PROMPT_LENGTHS = [40, 56, 70]
NUM_BLOCKS = 80  # preempts: a request holds up to ~60 blocks over the 6 groups


def _llm(folder: str, draft: str | None, **options) -> LLM:
    speculative = None if draft is None else {"model": draft, "num_speculative_tokens": 3}
    return LLM(folder, block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=7,
               speculative_config=speculative, debug_invariants=True, **options)


def test_a_hybrid_gemma3_as_its_own_draft_matches_hf_and_is_accepted(tiny_gemma_dir):
    folder, hf_model = tiny_gemma_dir("gemma3")
    llm = _llm(folder, folder, num_kv_blocks=192)
    assert llm.llm_engine.scheduler_config.kv_groups.num_groups == 6
    check_hybrid_oracle(llm, hf_model, hf_model.config.sliding_window)
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_acceptance_rate"] > 0.9, stats


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_another_draft_on_a_hybrid_target_changes_nothing_under_preemption(tiny_gemma_dir, tiny_llama,
                                                                           mode):
    folder, hf_model = tiny_gemma_dir("gemma3")
    llm = _llm(folder, tiny_llama, num_kv_blocks=NUM_BLOCKS, preemption_mode=mode, swap_space=0.01)
    batch = prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(NEW_TOKENS), use_tqdm=False)
    plain = _llm(folder, None, num_kv_blocks=NUM_BLOCKS, preemption_mode=mode, swap_space=0.01)
    without = plain.generate([{"prompt_token_ids": p} for p in batch], greedy(NEW_TOKENS), use_tqdm=False)
    for prompt, output, reference in zip(batch, outputs, without):
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 0, stats
    assert_pool_free(llm)
    assert_pool_free(plain)

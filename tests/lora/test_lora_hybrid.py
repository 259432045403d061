"""LoRA with a hybrid KV layout (several KV cache groups), against Hugging Face + PEFT.

A tiny random Qwen2 whose first layer attends fully and whose second slides (window 12):
two groups of one layer each, so both layers read and write one slot tensor
(``worker.block_moves.layer_caches``). An adapter's run of pages is one stretch per group
(``lora/page_layout.py``); were both layers' weights in one stretch, the second layer's
would overwrite the first's. Greedy output with each adapter, and with rows of both
adapters and of the base in one batch, equals PEFT's on prompts several windows long;
the pool is all-free afterwards.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_pool_free
from tests.engine.test_sliding_window import prompts as window_prompts
from tests.lora.adapters import make_peft_adapter, peft_greedy

MAX_TOKENS = 16
PROMPT_LENGTHS = [40, 70, 55]
# Every projection at rank 8, and q/v only at rank 4.
ADAPTERS = {"all8": dict(rank=8, seed=1), "qv4": dict(rank=4, targets=("q_proj", "v_proj"), seed=2)}


@pytest.fixture(scope="module")
def hybrid_base(sliding_model) -> str:
    folder, _ = sliding_model("qwen2-hybrid")
    return folder


@pytest.fixture(scope="module")
def adapters(hybrid_base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-adapters")
    return {name: make_peft_adapter(hybrid_base, str(root / name), **options) for name, options in ADAPTERS.items()}


def test_adapters_on_a_hybrid_layout_equal_peft(hybrid_base, adapters, smollm_tokenizer):
    batch = window_prompts(smollm_tokenizer, PROMPT_LENGTHS)
    oracle = {name: peft_greedy(hybrid_base, None if name is None else adapters[name], batch, MAX_TOKENS)
              for name in (None, *adapters)}
    assert oracle["all8"] != oracle[None] != oracle["qv4"]  # the adapters change the output
    llm = LLM(hybrid_base, enable_lora=True, max_lora_rank=8, num_kv_blocks=160, block_size=4,
              max_num_batched_tokens=16, long_prefill_token_threshold=7, debug_invariants=True)
    groups = llm.llm_engine.scheduler_config.kv_groups
    assert (groups.num_groups, groups.num_slots) == (2, 1)
    requests = {None: None, **{name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def tokens(loras) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, lora_request=loras, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    for name, request in requests.items():
        assert tokens(request) == oracle[name], name
    names = ["qv4", None, "all8"]
    assert tokens([requests[n] for n in names]) == [oracle[n][i] for i, n in enumerate(names)]
    # The run is one stretch per group.
    runner = llm.llm_engine.runner.adapters
    _, layout = runner.placed["all8"]
    spec = llm.llm_engine.adapter_registry.spec_for(requests["all8"])
    assert spec.num_pages == layout.num_blocks == 2 * layout.num_pages
    assert_pool_free(llm)

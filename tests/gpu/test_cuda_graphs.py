"""CUDA graphs for decode steps on a real GPU: captured at start-up, replayed
for decode-only steps padded to the next captured size, and greedy output
token for token the same as ``enforce_eager``. Skipped without a GPU
(tests/worker/test_decode_graph_padding.py checks the padding on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.cuda_graphs import DecodeGraphs
from tests.conftest import assert_pool_free

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def replay_counter(monkeypatch):
    counts = {"replays": 0}
    run = DecodeGraphs.run

    def counting(self, *args):
        counts["replays"] += 1
        return run(self, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counting)
    return counts


def greedy(llm: LLM, num_prompts: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    words = "paged attention keeps a block table per sequence and follows it".split()
    prompts = [tokenizer.encode(" ".join(words[i % len(words) :] + words[: i % len(words)]) * (1 + i % 3))
               for i in range(num_prompts)]
    # Different lengths: the decode batch shrinks through several padded sizes.
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 7), ignore_eos=True) for i in range(num_prompts)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_greedy(dtype, replay_counter):
    """1, 3, 13 and 40 requests: decode steps padded to 1, 4, 16, 64 and every size below."""
    options = dict(device="cuda", dtype=dtype, num_kv_blocks=1024, max_num_seqs=64)
    with_graphs = LLM(**options)
    graphs = with_graphs.llm_engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 32, 64]
    counts = [1, 3, 13, 40]
    got = [greedy(with_graphs, n) for n in counts]
    assert replay_counter["replays"] > 0
    del with_graphs
    eager = LLM(enforce_eager=True, **options)
    assert eager.llm_engine.runner.decode_graphs is None
    assert got == [greedy(eager, n) for n in counts]


def test_ladder_stops_at_max_num_seqs(replay_counter):
    llm = LLM(device="cuda", num_kv_blocks=1024, max_num_seqs=4)
    assert llm.llm_engine.runner.decode_graphs.sizes == [1, 2, 4]
    outputs = greedy(llm, 9)  # more requests than max_num_seqs: they queue, never a step past 4
    assert all(outputs) and replay_counter["replays"] > 0

"""The CUDA-graph decode path without CUDA: static buffers, padding to the next
captured size, the scratch pad block, stale rows of a larger earlier step.

Graph capture itself needs a GPU (tests/gpu/test_cuda_graphs.py); here each
"graph" replays the same forward eagerly over the same static buffers, so
everything the runner does around a replay runs on the CPU and greedy output
must equal the plain eager engine's.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.selector import attention_backend_for
from pagedllm.worker import model_runner
from pagedllm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, why_no_graphs
from tests.conftest import assert_pool_free


class EagerReplay:
    """Stands in for a captured graph: replay() recomputes its static output."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.output = graphs._forward(size)
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.graphs._forward(self.size))
        self.replays += 1


@pytest.fixture
def eager_graphs(monkeypatch):
    """Runners built while this is active take the graph path on the CPU."""
    captured: list[DecodeGraphs] = []

    def capture(self: DecodeGraphs) -> None:
        for size in self.sizes:
            replay = EagerReplay(self, size)
            self._graphs[size] = (replay, replay.output)
        captured.append(self)

    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    monkeypatch.setattr(model_runner, "why_no_graphs", lambda *args: None)
    return captured


def test_ladder_and_guards():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    cpu = torch.device("cpu")
    assert "CUDA device" in why_no_graphs(torch.nn.Linear(1, 1), cpu, attention_backend_for(cpu, 16))


def test_cpu_engine_has_no_graphs(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    assert llm.llm_engine.runner.decode_graphs is None


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # Different lengths: the decode batch shrinks through several padded sizes.
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_free(llm)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("num_prompts", [1, 3, 6])
def test_padded_graph_path_matches_eager(tiny_llama, eager_graphs, num_prompts):
    prompts = [[(11 * i + j) % 500 + 1 for j in range(5 + 4 * i)] for i in range(num_prompts)]
    graphs_llm = LLM(tiny_llama, num_kv_blocks=64, max_num_seqs=8, enforce_eager=False)
    (graphs,) = eager_graphs
    assert graphs.sizes == [1, 2, 4, 8]
    # The pad block lies past the scheduler's pool.
    assert graphs.pad_block == graphs_llm.stats()["num_blocks"]
    got = generate(graphs_llm, prompts)
    eager_llm = LLM(tiny_llama, num_kv_blocks=64, max_num_seqs=8, enforce_eager=True)
    assert len(eager_graphs) == 1  # enforce_eager captured nothing
    assert got == generate(eager_llm, prompts)
    assert sum(replay.replays for replay, _ in graphs._graphs.values()) >= 6 + 3 * (num_prompts - 1) - 1

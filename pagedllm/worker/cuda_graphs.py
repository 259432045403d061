"""CUDA graphs for decode-only steps.

A decode step of a small model spends most of its time launching kernels from
Python. At start-up the runner captures one graph of the whole forward per
batch size of a ladder (1, 2, 4, 8, ... up to ``max_num_seqs``) over static
input buffers; a decode-only step copies its inputs into the buffers, pads
them to the next captured size and replays that graph. Prefill and mixed
steps, and steps larger than the largest size, run eagerly.

Safety rules:

* Padded rows must not touch a real sequence's KV: they write their (garbage)
  K/V to a scratch block past the scheduler's pool (``pad_block``, allocated
  by the runner and never handed out) and read only that block.
* The captured forward must not sync with the host or depend on data for its
  shapes: the decode block tables have the static width
  ``cdiv(max_model_len, block_size)``, and graphs are used only when decodes
  go through a paged decode kernel (which reads only the blocks a context
  covers; the PyTorch gather fallback would read the whole width) and no rope
  depends on sequence length (those decide rows on the host each step).
* The returned hidden states are a view of the graph's static output: valid
  until the next replay, so the step samples from them before the next one.
"""

from __future__ import annotations

import bisect
import time

import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.logger import init_logger
from pagedllm.model.base import CausalLM
from pagedllm.utils import cdiv

logger = init_logger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


def why_no_graphs(model: CausalLM, device: torch.device, attention: TorchPagedAttention,
                  num_kv_groups: int = 1) -> str | None:
    """Why decode steps of this model cannot be captured here (None: they can);
    ``num_kv_groups``: the KV cache groups of its layout (``core.kv_groups``)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if num_kv_groups > 1:
        return (f"a hybrid KV cache layout's {num_kv_groups} groups each read their own block tables, "
                "which the captured decode step does not carry")
    if attention.decode_kernel is None:
        return ("CUDA graphs need the paged decode kernel (Triton, a power-of-two block size, an auto pool or "
                "int8 without full-precision tails)")
    if model.rope_depends_on_length:
        return "this model's rope depends on sequence length, which a captured graph cannot follow"
    return None


class DecodeGraphs:
    """One captured forward per batch size, over shared static input buffers."""

    def __init__(self, model: CausalLM, kv_caches: list[LayerKVCache], attention: TorchPagedAttention,
                 max_num_seqs: int, max_model_len: int, block_size: int, pad_block: int) -> None:
        self.model, self.kv_caches, self.attention = model, kv_caches, attention
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = block_size
        self.pad_block = pad_block
        device = kv_caches[0].key.device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), pad_block * block_size, dtype=torch.long, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.long, device=device)
        self.block_tables = torch.full((largest, cdiv(max_model_len, block_size)), pad_block,
                                       dtype=torch.long, device=device)
        self._num_live = 0  # rows of the buffers the last step filled with real sequences
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decodes=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_context_lens=self.context_lens[:size], prefills=[])

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size),
                          self.attention)

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory
        pool), after an eager warm-up that compiles the kernels. Logs the cost."""
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)  # kernels compile / pick their algorithms outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._forward(size)
            self._graphs[size] = (graph, output)
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        logger.info("Captured CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)",
                    self.sizes, time.perf_counter() - started, used)

    def fits(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Whether a step is decode-only and small and short enough to replay."""
        return (not metadata.prefills and metadata.num_decodes == num_tokens <= self.sizes[-1]
                and metadata.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the smallest size >= the step's decodes (see ``fits``)."""
        count = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, count)]
        self.input_ids[:count].copy_(input_ids, non_blocking=True)
        self.positions[:count].copy_(positions, non_blocking=True)
        self.slot_mapping[:count].copy_(metadata.slot_mapping, non_blocking=True)
        self.context_lens[:count].copy_(metadata.decode_context_lens, non_blocking=True)
        width = metadata.decode_block_tables.shape[1]
        self.block_tables[:count, :width].copy_(metadata.decode_block_tables, non_blocking=True)
        # Rows a larger earlier step filled become padding again; rows past
        # every earlier step still hold their initial padding.
        if self._num_live > count:
            stale = slice(count, self._num_live)
            self.input_ids[stale] = 0
            self.positions[stale] = 0
            self.slot_mapping[stale] = self.pad_block * self.block_size
            self.context_lens[stale] = 1
            self.block_tables[stale] = self.pad_block
        self._num_live = count
        graph, output = self._graphs[size]
        graph.replay()
        return output[:count]

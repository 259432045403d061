"""The runner's LoRA adapters: page-ins (weights read from disk into their pool
pages) and each step's per-row adapter work for the model's ``LoRAProjection``s."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.core.block_moves import AdapterLoad
from pagedllm.lora.adapter_files import read_adapter
from pagedllm.lora.layers import LoRAContext, LoRAStep, PartRows, install_lora, part_rows, uses_kernel
from pagedllm.lora.page_layout import AdapterLayout, adapter_layout, projection_shapes
from pagedllm.lora.shard import shard_weights
from pagedllm.lora.weights import LORA_MODULES
from pagedllm.logger import init_logger

logger = init_logger(__name__)


class RunnerAdapters:
    """Where each resident adapter's pages start and how they are laid out.

    Safety rule: a sequence names an adapter only while the KV manager holds it
    pinned for it, and the manager pins only after queueing its page-in (if it was
    not resident), so the latest load of a name is the one its sequences read; stale
    entries of evicted adapters are never named again before they are reloaded.
    """

    def __init__(self, model: torch.nn.Module, config: Any, layer_caches: Sequence[Any], dtype: torch.dtype,
                 max_lora_rank: int, device: torch.device, page_elems: int) -> None:
        """``layer_caches``: the model's per-layer caches (``block_moves.layer_caches``), so
        each layer's pages are its slot tensor and its group says which stretch is its."""
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.tp = model.tp  # this rank's share: adapters are sharded as the projections are
        self.shapes = projection_shapes(config, self.tp)
        self.page_elems = page_elems  # the runner's ``adapter_page_elems``
        groups = [c.group for c in layer_caches]
        self.num_groups = max(groups) + 1
        self.context = LoRAContext([c.key for c in layer_caches], [c.value for c in layer_caches], groups, dtype)
        install_lora(model, self.context)
        self.use_kernel = uses_kernel(device, dtype)
        self.placed: dict[str, tuple[int, AdapterLayout]] = {}
        # Page-ins done and the seconds they took (read from disk + written into the pages): the
        # cost a multi-LoRA workload pays for adapters that are not resident (`pagedllm bench lora`).
        self.num_loads = 0
        self.load_seconds = 0.0

    def load(self, loads: Sequence[AdapterLoad]) -> None:
        """Read each adapter and write it into its pages (every layer's key and value rows)."""
        for load in loads:
            start = time.perf_counter()
            weights = shard_weights(read_adapter(load.path, self.config, self.max_lora_rank), self.config, self.tp)
            layout = adapter_layout(weights.rank, weights.target_modules, self.shapes, self.page_elems,
                                    self.num_groups)
            for (layer, module), (a, b) in weights.tensors.items():
                base = layout.page_start(load.first_block, self.context.groups[layer], self.page_elems)
                a_start = base + layout.a_offsets[module]
                b_start = base + layout.b_offsets[module]
                self.context.a_pages[layer][a_start: a_start + a.numel()] = a.reshape(-1).to(self.dtype)
                self.context.b_pages[layer][b_start: b_start + b.numel()] = (b * weights.scaling).reshape(-1).to(
                    self.dtype)
            self.placed[load.name] = (load.first_block, layout)
            self.num_loads += 1
            self.load_seconds += time.perf_counter() - start

    def set_step(self, runs: list[tuple[int, int, str | None]], num_rows: int) -> None:
        """The next forward's rows: ``runs`` (start row, end row, adapter name or None) in row order."""
        adapter_runs = [run for run in runs if run[2] is not None]
        if not adapter_runs:
            self.context.step = None
            return
        self.context.step = LoRAStep([self._group_parts(adapter_runs, num_rows, group)
                                      for group in range(self.num_groups)])

    def _group_parts(self, adapter_runs: list[tuple[int, int, str | None]], num_rows: int,
                     group: int) -> dict[str, PartRows]:
        """The step's work for the layers of KV cache group ``group``, by part name."""
        parts = {}
        for module in LORA_MODULES:
            module_runs = []
            for start, end, name in adapter_runs:
                first_block, layout = self.placed[name]
                if module in layout.a_offsets:
                    base = layout.page_start(first_block, group, self.page_elems)
                    module_runs.append((start, end, base + layout.a_offsets[module], base + layout.b_offsets[module],
                                        layout.rank))
            if module_runs:
                parts[module] = part_rows(num_rows, module_runs, self.use_kernel, self.device)
        return parts

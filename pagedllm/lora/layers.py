"""The model side of multi-LoRA: projections that add each row's adapter product.

``install_lora`` wraps every layer's q|k|v, o, gate|up and down projections in a
``LoRAProjection``. Its forward runs the base projection (dense, packed or GGUF:
whatever module was there), then adds, for each part of the fused output
(q, k and v of ``qkv_proj``; gate and up of ``gate_up_proj``), every row's
``x @ A.T @ B.T`` for the adapter that row runs under, reading A and B in place
from the KV pool's pages (``lora/page_layout.py``). Nothing is merged into the
base weights, so one step mixes rows of many adapters and of the base.

Rows come in runs (a sequence's tokens are consecutive rows). A run of at least
``SEGMENT_ROWS`` rows (a prefill chunk) is two matmuls over the run, as SGMV
does; the other rows (decodes) go to the C++ kernel in one call per part
(``lora_bgmv``: per-row gather, as BGMV does), or, without the kernels, to
matmuls per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.lora.page_layout import projection_shapes
from pagedllm.model.layers import linear, replace_submodule

# Runs this long or longer are multiplied as matrices; shorter ones row by row in the kernel.
SEGMENT_ROWS = 32


@dataclass
class PartRows:
    """One projection part's work in a step: ``kernel`` (per-row a offset, b offset and
    rank tensors over all the step's rows, rank 0 for rows it skips; None when no row
    needs it) and ``segments`` (start row, end row, a offset, b offset, rank) for matmuls."""

    kernel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    segments: list[tuple[int, int, int, int, int]] = field(default_factory=list)


@dataclass
class LoRAStep:
    """A step's LoRA work per KV cache group, by part name (``q_proj``, ...): what
    ``LoRAProjection`` reads (a group's layers keep their weights in its own stretch
    of each adapter's pages, ``lora/page_layout.py``)."""

    parts: list[dict[str, PartRows]]


class LoRAContext:
    """Shared by one model's LoRA projections: each layer's pages as flat views of the
    model's dtype (A in the key tensor, B in the value tensor), each layer's KV cache
    group (``groups``), and the current step (None: no row runs an adapter). The runner
    sets ``step`` before each forward."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], groups: list[int],
                 dtype: torch.dtype) -> None:
        self.a_pages = [key.view(-1).view(dtype) for key in keys]
        self.b_pages = [value.view(-1).view(dtype) for value in values]
        self.groups = groups
        self.step: LoRAStep | None = None


class LoRAProjection(nn.Module):
    """``base`` plus the step's adapter products on its output parts:
    ``parts`` lists (module name, first output column, width)."""

    def __init__(self, base: nn.Module, context: LoRAContext, layer_index: int,
                 parts: list[tuple[str, int, int]]) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.layer_index = layer_index
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.context.step
        if step is None:
            return out
        a_pages, b_pages = self.context.a_pages[self.layer_index], self.context.b_pages[self.layer_index]
        parts = step.parts[self.context.groups[self.layer_index]]
        for name, column, width in self.parts:
            rows = parts.get(name)
            if rows is not None:
                add_lora(out, x, a_pages, b_pages, rows, column, width)
        return out


def add_lora(out: torch.Tensor, x: torch.Tensor, a_pages: torch.Tensor, b_pages: torch.Tensor,
             rows: PartRows, column: int, width: int) -> None:
    """out[:, column:column+width] += each row's x @ A.T @ B.T (B holds the scaling)."""
    in_features = x.shape[1]
    for start, end, a_offset, b_offset, rank in rows.segments:
        a = a_pages[a_offset: a_offset + rank * in_features].view(rank, in_features)
        b = b_pages[b_offset: b_offset + width * rank].view(width, rank)
        out[start:end, column: column + width] += linear(linear(x[start:end], a), b)
    if rows.kernel is not None:
        kernels = cpu_kernels_for(x)
        a_offsets, b_offsets, ranks = rows.kernel
        kernels.lora_bgmv(out, x, a_pages, b_pages, a_offsets, b_offsets, ranks, column, width)


def lora_parts(config: Any, tp: TensorParallelGroup) -> dict[str, list[tuple[str, int, int]]]:
    """The wrapped projection of each layer -> its parts (name, first column, width), on rank ``tp.rank``."""
    shapes = projection_shapes(config, tp)
    q, kv, inter = shapes["q_proj"][1], shapes["k_proj"][1], shapes["gate_proj"][1]
    hidden = shapes["o_proj"][1]
    return {"self_attn.qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
            "self_attn.o_proj": [("o_proj", 0, hidden)],
            "mlp.gate_up_proj": [("gate_proj", 0, inter), ("up_proj", inter, inter)],
            "mlp.down_proj": [("down_proj", 0, hidden)]}


def install_lora(model: nn.Module, context: LoRAContext) -> None:
    """Wrap every decoder layer's projections of ``model`` (a loaded ``LlamaForCausalLM``
    family model) in ``LoRAProjection``s over ``context``. ValueError for a mixture of
    experts: its expert weights are stacked tensors, not projections an adapter targets."""
    sparse = [index for index, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    if sparse:
        raise ValueError(f"LoRA is not supported on mixture-of-experts models ({model.config.model_type}) yet: "
                         f"layers {sparse} hold expert weights (mlp.experts.gate_up_proj, mlp.experts.down_proj) "
                         "that adapters cannot target; start the engine without enable_lora")
    for index, layer in enumerate(model.model.layers):
        for name, parts in lora_parts(model.config, model.tp).items():
            replace_submodule(layer, name, LoRAProjection(layer.get_submodule(name), context, index, parts))


def uses_kernel(x_device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode rows go to the C++ kernel (CPU, fp32/bf16, kernels built)."""
    probe = torch.empty(0, dtype=dtype, device=x_device)
    kernels = cpu_kernels_for(probe)
    return kernels is not None and hasattr(kernels, "lora_bgmv") and dtype in (torch.float32, torch.bfloat16)


def part_rows(num_rows: int, runs: list[tuple[int, int, int, int, int]], use_kernel: bool,
              device: torch.device) -> PartRows:
    """Split one part's runs (start, end, a offset, b offset, rank) between matmuls and the kernel."""
    rows = PartRows()
    short = []
    for run in runs:
        if use_kernel and run[1] - run[0] < SEGMENT_ROWS:
            short.append(run)
        else:
            rows.segments.append(run)
    if short:
        table = np.zeros((3, num_rows), dtype=np.int64)
        for start, end, a_offset, b_offset, rank in short:
            table[:, start:end] = np.array([[a_offset], [b_offset], [rank]])
        tensors = torch.from_numpy(table).to(device)
        rows.kernel = (tensors[0], tensors[1], tensors[2])
    return rows

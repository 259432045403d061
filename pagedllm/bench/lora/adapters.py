"""Random rank-r PEFT LoRA folders for a base model, written directly with safetensors.

Running PEFT to make 256 adapters would take minutes and load the model 256 times; a
folder is only ``adapter_config.json`` plus ``adapter_model.safetensors`` holding
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` ([r, in])
and ``...lora_B.weight`` ([out, r]), so the bench writes that itself. Values are
random (std ``VALUE_STD``), stored as bf16 to halve the files (the reader converts to
fp32). Folders are keyed by the model's shapes, the rank and the targets, and reused
when they exist: a set is written once per machine. Each is written under a
temporary name and renamed, so an interrupted run never leaves a half-written folder
that a later run would reuse.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from pagedllm.lora.page_layout import projection_shapes
from pagedllm.lora.weights import LORA_MODULES

VALUE_STD = 0.02
_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def adapter_set_dir(root: str, config: Any, rank: int, targets: tuple[str, ...]) -> str:
    """The folder holding the adapters of one (model shape, rank, targets): different models or
    settings never reuse each other's files."""
    shape = f"{config.model_type}-{config.num_hidden_layers}x{config.hidden_size}x{config.intermediate_size}"
    modules = "".join(module[0] for module in LORA_MODULES if module in targets)  # q k v o g u d
    return os.path.join(root, f"{shape}-r{rank}-{modules}")


def write_adapters(root: str, config: Any, count: int, rank: int, targets: tuple[str, ...],
                   names: list[str] | None = None) -> list[str]:
    """``count`` adapter folders for the model of ``config`` (``adapter-000``, ... or ``names``),
    written when missing; returns their paths."""
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; choose among {', '.join(LORA_MODULES)}")
    folder = adapter_set_dir(root, config, rank, targets)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for index, name in enumerate(names or [f"adapter-{i:03d}" for i in range(count)]):
        path = os.path.join(folder, name)
        if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
            _write_one(path, config, rank, targets, seed=index)
        paths.append(path)
    return paths


def _write_one(path: str, config: Any, rank: int, targets: tuple[str, ...], seed: int) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = projection_shapes(config)
    for layer in range(config.num_hidden_layers):
        for module in LORA_MODULES:
            if module not in targets:
                continue
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_PARENTS[module]}.{module}"
            for half, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
                values = torch.randn(shape, generator=generator).mul_(VALUE_STD)
                tensors[f"{prefix}.lora_{half}.weight"] = values.to(torch.bfloat16)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets),
                "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    partial = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(tensors, os.path.join(partial, "adapter_model.safetensors"))
    with open(os.path.join(partial, "adapter_config.json"), "w", encoding="utf-8") as handle:
        json.dump(settings, handle, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(partial, path)


def folder_megabytes(path: str) -> float:
    """The adapter's size on disk, in MB (10^6 bytes)."""
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)) / 1e6

"""Hugging Face PEFT LoRA folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

What ``save_pretrained`` writes for a ``LoraConfig``: per targeted module
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]); the module's output gains ``scaling * B @ A @ x`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). The tensors in the file decide which modules
and layers the adapter targets; the config is read for what changes the arithmetic, and every
option this engine would have to ignore (DoRA, biases, saved modules, per-module ranks) is
refused rather than dropped, since dropping it would serve another model than the one trained.

Pickled ``adapter_model.bin`` files are refused: loading one runs arbitrary code.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.lora.adapter_files import AdapterInfo, AdapterShapes, adapter_info, check_shapes, check_target_module
from pagedllm.lora.weights import LoRAWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"

_KEY = re.compile(r"base_model\.model\.(?P<path>.+)\.lora_(?P<half>[AB])\.weight")
_LAYER_PATH = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+)")
_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_FLOAT_DTYPES = ("F32", "F16", "BF16")
# Config options that change what the adapter computes in ways this engine does not serve: the
# key, whether its value is refused, and what to change.
_REFUSED_OPTIONS = (
    ("use_dora", lambda v: bool(v), "DoRA is not served; train a plain LoRA (use_dora=False)"),
    ("bias", lambda v: v not in (None, "none"), "trained biases are not served; train with bias='none'"),
    ("lora_bias", lambda v: bool(v), "a bias on lora_B is not served; train with lora_bias=False"),
    ("modules_to_save", lambda v: bool(v),
     "whole saved modules are not served; train without modules_to_save"),
    ("fan_in_fan_out", lambda v: bool(v),
     "Conv1D-style [in, out] weights are not served; only Linear projections ([out, in])"),
    ("rank_pattern", lambda v: bool(v), "per-module ranks are not served; use one r for every module"),
    ("alpha_pattern", lambda v: bool(v), "per-module alphas are not served; use one lora_alpha for every module"),
)


@dataclass(frozen=True)
class _Plan:
    """A checked folder: its ``AdapterInfo``, the safetensors file, each pair's (A, B) keys."""

    info: AdapterInfo
    weights_file: str
    keys: dict[tuple[int, str], tuple[str, str]]


def check_peft_folder(folder: str, config: Any, max_lora_rank: int) -> AdapterInfo:
    """The folder checked from adapter_config.json and the safetensors header alone."""
    return _plan(folder, config, max_lora_rank).info


def read_peft_folder(folder: str, config: Any, max_lora_rank: int) -> LoRAWeights:
    """The folder checked, then its tensors read as fp32 CPU contiguous."""
    plan = _plan(folder, config, max_lora_rank)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    with _opened(plan.weights_file) as file:
        for key, (a_key, b_key) in plan.keys.items():
            tensors[key] = (_fp32(file.get_tensor(a_key)), _fp32(file.get_tensor(b_key)))
    return LoRAWeights(rank=plan.info.rank, scaling=plan.info.scaling, tensors=tensors)


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device="cpu", dtype=torch.float32).contiguous()


def _plan(folder: str, config: Any, max_lora_rank: int) -> _Plan:
    source = f"LoRA adapter {folder!r}"
    settings = _adapter_config(folder, source)
    weights_file = _weights_file(folder, source)
    with _opened(weights_file) as file:
        shapes, keys = _tensor_shapes(file, source)
    rank = check_shapes(shapes, config, max_lora_rank, source)
    declared = settings.get("r")
    if declared != rank:
        raise ValueError(f"{source}: adapter_config.json says r={declared!r} but its tensors have rank {rank}; "
                         "the folder's files do not belong together")
    alpha = settings.get("lora_alpha", 8)  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{source}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return _Plan(adapter_info(shapes, rank, scaling), weights_file, keys)


def _adapter_config(folder: str, source: str) -> dict[str, Any]:
    """adapter_config.json, parsed and checked option by option."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{source} has no {CONFIG_FILE}: a PEFT LoRA folder is what save_pretrained writes "
                         f"({CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        with open(path, encoding="utf-8") as handle:
            settings = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{source}: {CONFIG_FILE} is not valid JSON ({error})") from error
    if not isinstance(settings, dict):
        raise ValueError(f"{source}: {CONFIG_FILE} must hold a JSON object")
    if settings.get("peft_type") != "LORA":
        raise ValueError(f"{source}: peft_type is {settings.get('peft_type')!r}; only LORA adapters are served")
    for key, refused, advice in _REFUSED_OPTIONS:
        if refused(settings.get(key)):
            raise ValueError(f"{source}: {CONFIG_FILE} sets {key}={settings[key]!r}: {advice}")
    rank = settings.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{source}: r must be an integer >= 1, got {rank!r}")
    targets = settings.get("target_modules")
    if isinstance(targets, (list, tuple)):  # a regex string matches module paths: the tensors decide
        for target in targets:
            check_target_module(str(target).rsplit(".", 1)[-1], source)
    return settings


def _weights_file(folder: str, source: str) -> str:
    path = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(path):
        return path
    if os.path.isfile(os.path.join(folder, PICKLED_WEIGHTS_FILE)):
        raise ValueError(f"{source} holds {PICKLED_WEIGHTS_FILE}, a pickle, which is not read (loading one runs "
                         "code); save the adapter with safetensors: save_pretrained(..., safe_serialization=True)")
    raise ValueError(f"{source} has no {WEIGHTS_FILE}")


@contextmanager
def _opened(path: str) -> Iterator[Any]:
    """``safe_open`` with the library's errors (a cut-short or corrupt file) as ValueError."""
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            yield file
    except SafetensorError as error:
        raise ValueError(f"{path!r} is not a readable safetensors file ({error}); it may be truncated "
                         "or corrupt: save the adapter again") from error


def _tensor_shapes(file: Any, source: str) -> tuple[AdapterShapes, dict[tuple[int, str], tuple[str, str]]]:
    """Each (layer, module)'s A and B shapes from the header, and the keys that hold them."""
    shapes: AdapterShapes = {}
    names: dict[tuple[int, str], dict[str, str]] = {}
    for key in file.keys():
        layer, module, half = _parse_key(key, source)
        tensor = file.get_slice(key)
        if tensor.get_dtype() not in _FLOAT_DTYPES:
            raise ValueError(f"{source}: tensor {key!r} is {tensor.get_dtype()}; LoRA tensors must be "
                             f"one of {', '.join(_FLOAT_DTYPES)}")
        shapes.setdefault((layer, module), {})[half] = tuple(int(size) for size in tensor.get_shape())
        names.setdefault((layer, module), {})[half] = key
    keys = {pair: (halves.get("A", ""), halves.get("B", "")) for pair, halves in names.items()}
    return shapes, keys


def _parse_key(key: str, source: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.mlp.up_proj.lora_B.weight`` -> (3, "up_proj", "B")."""
    if "lora_embedding_" in key:
        check_target_module("embed_tokens", source)  # PEFT's name for an embedding's A and B
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{source}: unexpected tensor {key!r}; a served LoRA file holds only the lora_A and "
                         "lora_B weights of the targeted projections")
    path = match["path"]
    check_target_module(path.rsplit(".", 1)[-1], source)
    layer_path = _LAYER_PATH.fullmatch(path)
    if layer_path is None or _PARENTS[layer_path["module"]] != layer_path["parent"]:
        raise ValueError(f"{source}: tensor {key!r} is not in a decoder layer of a Llama-family model "
                         "(model.layers.{i}.self_attn or .mlp)")
    return int(layer_path["layer"]), layer_path["module"], match["half"]

"""llama.cpp GGUF LoRA files, as ``convert_lora_to_gguf.py`` writes them.

The layout, from that script and llama.cpp's loader (``llama-adapter.cpp``):

- metadata ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha`` (f32;
  absent reads as 0) and ``general.architecture``;
- per targeted projection ``blk.{i}.attn_q.weight.lora_a`` and ``.lora_b``: PEFT's A and B
  unchanged, not transposed. GGUF lists dimensions fastest first, so A's ``ne`` is [in, rank]
  and B's [rank, out]; reversed into torch order they are A [rank, in] and B [out, rank];
- for the architectures whose converter permutes q/k rows into llama.cpp's interleaved rope
  layout (llama and its relatives), the same permutation is applied to the lora_b of attn_q
  and attn_k (A's columns index the input, which is not permuted). It is undone here with the
  model loader's own function, so the result is in Hugging Face order again;
- llama.cpp scales by ``alpha / rank``, and by 1.0 when alpha is 0 (``get_scale``). The
  converter writes ``lora_alpha`` as is, so an rslora adapter converted this way runs with
  ``alpha / rank`` in llama.cpp, and here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGMLQuantizationType

from pagedllm.lora.adapter_files import AdapterInfo, AdapterShapes, adapter_info, check_shapes, check_target_module
from pagedllm.lora.weights import LoRAWeights
from pagedllm.model.gguf_config import GLOBAL_NAMES, GGUFArchitecture, gguf_architecture, metadata
from pagedllm.model.gguf_file import dequantize_tensor, unpermute_rope_rows
from pagedllm.model.gguf_reader import GGUFFile, GGUFTensor, read_gguf
from pagedllm.model.shapes import num_kv_heads_of

# llama.cpp's projection names -> Hugging Face's (the servable ones).
_PARTS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<part>\w+)\.weight\.lora_(?P<half>[ab])")
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class _Plan:
    """A checked file: its ``AdapterInfo``, each pair's (A, B) tensors, whether q/k rows are permuted."""

    info: AdapterInfo
    tensors: dict[tuple[int, str], tuple[GGUFTensor, GGUFTensor]]
    unpermute_qk: bool


def check_gguf_lora(path: str, config: Any, max_lora_rank: int) -> AdapterInfo:
    """The file checked from its metadata and tensor table alone (no tensor decoded)."""
    return _plan(path, config, max_lora_rank).info


def read_gguf_lora(path: str, config: Any, max_lora_rank: int) -> LoRAWeights:
    """The file checked, then decoded to fp32 CPU contiguous tensors in Hugging Face order."""
    plan = _plan(path, config, max_lora_rank)
    row_groups = {"q_proj": config.num_attention_heads, "k_proj": num_kv_heads_of(config)}
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in plan.tensors.items():
        lora_a, lora_b = dequantize_tensor(a, torch.float32), dequantize_tensor(b, torch.float32)
        if plan.unpermute_qk and module in row_groups:
            lora_b = unpermute_rope_rows(lora_b, row_groups[module])
        tensors[(layer, module)] = (lora_a.contiguous(), lora_b.contiguous())
    return LoRAWeights(rank=plan.info.rank, scaling=plan.info.scaling, tensors=tensors)


def _plan(path: str, config: Any, max_lora_rank: int) -> _Plan:
    source = f"GGUF LoRA {path!r}"
    try:
        reader = read_gguf(path)
    except ValueError as error:
        raise ValueError(f"{source} is not a readable GGUF file: {error}") from error
    alpha, layout = _check_metadata(reader, source)
    pairs = _lora_tensors(reader, layout, source)
    shapes: AdapterShapes = {key: {half: _torch_shape(tensor) for half, tensor in halves.items()}
                             for key, halves in pairs.items()}
    rank = check_shapes(shapes, config, max_lora_rank, source)
    scaling = alpha / rank if alpha else 1.0  # llama.cpp's get_scale
    tensors = {key: (halves["A"], halves["B"]) for key, halves in pairs.items()}
    return _Plan(adapter_info(shapes, rank, scaling), tensors, layout.unpermute_qk)


def _check_metadata(reader: GGUFFile, source: str) -> tuple[float, GGUFArchitecture]:
    """(alpha, the architecture's GGUF layout: whether q/k rows are permuted), or ValueError."""
    general_type = metadata(reader, "general.type", None)
    if general_type != "adapter":
        raise ValueError(f"{source} is not a LoRA adapter: general.type is {general_type!r}, not 'adapter' "
                         "(is it a model? convert_lora_to_gguf.py writes LoRA adapters)")
    adapter_type = metadata(reader, "adapter.type", None)
    if adapter_type != "lora":
        raise ValueError(f"{source} is not a LoRA adapter: adapter.type is {adapter_type!r}, not 'lora'")
    alpha = metadata(reader, "adapter.lora.alpha", 0.0)  # llama.cpp reads an absent alpha as 0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{source}: adapter.lora.alpha must be a number, got {alpha!r}")
    try:
        layout = gguf_architecture(metadata(reader, "general.architecture"))
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from error
    return float(alpha), layout


def _lora_tensors(reader: GGUFFile, layout: GGUFArchitecture,
                  source: str) -> dict[tuple[int, str], dict[str, GGUFTensor]]:
    """Each (layer, module)'s lora_a ("A") and lora_b ("B"), refusing anything else by name."""
    pairs: dict[tuple[int, str], dict[str, GGUFTensor]] = {}
    for tensor in reader.tensors:
        if tensor.name.endswith("_norm.weight"):
            raise ValueError(f"{source} holds the norm weight {tensor.name!r} (mergekit-extract-lora); "
                             "norm weights in an adapter are not served")
        match = _NAME.fullmatch(tensor.name)
        if match is None:
            raise ValueError(f"{source}: unexpected tensor {tensor.name!r}; a LoRA file holds "
                             "blk.{i}.<projection>.weight.lora_a / .lora_b pairs")
        part = match["part"]
        # an unservable projection is refused by its Hugging Face name (lm_head, qkv_proj, ...)
        hf_name = _PARTS.get(part) or layout.layer_names.get(part) or GLOBAL_NAMES.get(part) or part
        module = hf_name.rsplit(".", 1)[-1]
        check_target_module(module, source)
        if match["layer"] is None:
            raise ValueError(f"{source}: tensor {tensor.name!r} names no layer (blk.{{i}}.)")
        if tensor.tensor_type not in _FLOAT_TYPES:
            raise ValueError(f"{source}: tensor {tensor.name!r} is {tensor.tensor_type.name}; only F32, F16 and "
                             "BF16 LoRA tensors are read (convert with --outtype f32, f16 or bf16)")
        half = match["half"].upper()
        pairs.setdefault((int(match["layer"]), module), {})[half] = tensor
    return pairs


def _torch_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-varying first, torch the other way round."""
    return tuple(int(size) for size in reversed(tensor.shape))

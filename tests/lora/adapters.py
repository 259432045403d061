"""Test helpers for LoRA (not tests): adapters made by Hugging Face PEFT, PEFT's greedy output as
the oracle, and the llama.cpp GGUF LoRA layout written the way ``convert_lora_to_gguf.py`` does.

Everything here is independent of ``pagedllm.lora``: the files it writes and the tokens it
generates are what pagedllm's reader and engine are checked against.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch

from tests.conftest import hf_model_copy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# How large each module's update scaling * B @ A is made, as a fraction of the base weight's
# standard deviation: large enough that greedy output visibly changes, small enough that the
# adapted model is still a well-conditioned random model (its logits as separated as the base's).
UPDATE_TO_WEIGHT = 0.5
# llama.cpp's converters that permute q/k rows into the interleaved rope layout (LlamaModel and
# its subclasses in convert_hf_to_gguf.py); convert_lora_to_gguf.py permutes lora_b the same way.
PERMUTED_ARCHES = ("llama", "granite", "smollm3")
# Llama-family Hugging Face names -> llama.cpp tensor names.
GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
GGUF_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def make_peft_adapter(base_dir: str, out_dir: str, *, rank: int = 8, alpha: float = 16,
                      targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, seed: int = 0,
                      scale: float = 1.0) -> str:
    """A PEFT LoRA adapter for the model at ``base_dir`` (a Hugging Face folder or a .gguf file),
    saved to ``out_dir`` (safetensors) and returned.

    Every lora_A and lora_B is ``randn(seed) * scale * std``, with ``std`` per module such that
    ``scaling * B @ A`` has ``UPDATE_TO_WEIGHT`` times the base weight's standard deviation when
    ``scale`` is 1 (the update grows as ``scale ** 2``). PEFT's own init would leave B zero: an
    adapter that changes nothing."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    model = get_peft_model(hf_model_copy(base_dir), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
        init_lora_weights=False, lora_dropout=0.0))
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, LoraLayer):
                continue
            # entries of B @ A have std std**2 * sqrt(rank)
            update_std = UPDATE_TO_WEIGHT * module.base_layer.weight.float().std().item()
            std = math.sqrt(update_std / (abs(scaling) * math.sqrt(rank))) if scaling else 1.0
            for weight in (module.lora_A["default"].weight, module.lora_B["default"].weight):
                weight.copy_(torch.randn(weight.shape, generator=generator) * scale * std)
    model.peft_config["default"].base_model_name_or_path = os.path.abspath(base_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[str] | list[list[int]],
                max_tokens: int) -> list[list[int]]:
    """Hugging Face greedy generation (fp32, each prompt alone, no padding) under the PEFT adapter
    (``None``: the base alone): the generated token ids of each prompt.

    Generation stops at the model's EOS, the engine's default (no ``min_tokens``, no ``ignore_eos``);
    the EOS token, when reached, is kept as the last id (Hugging Face's ``generate`` keeps it).
    String prompts are tokenized with the base's tokenizer, without a chat template."""
    model = hf_model_copy(base_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    prompt_ids = [p if not isinstance(p, str) else _tokenizer(base_dir).encode(p) for p in prompts]
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            mask = torch.ones(1, len(ids), dtype=torch.long)
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def _tokenizer(base_dir: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if os.path.isfile(base_dir) and base_dir.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(base_dir))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(base_dir)


def write_gguf_lora(peft_dir: str, out_path: str, arch: str = "llama", *, base_dir: str | None = None,
                    dtype: str = "f32") -> str:
    """The PEFT adapter in ``peft_dir`` written as llama.cpp's ``convert_lora_to_gguf.py`` would
    (``--outtype dtype``): metadata general.type "adapter", adapter.type "lora",
    adapter.lora.alpha (lora_alpha as is, even with rslora); ``blk.{i}.{part}.weight.lora_a`` =
    A and ``.lora_b`` = B, neither transposed, with B's rows of attn_q / attn_k permuted as
    ``LlamaModel.permute`` does for the ``PERMUTED_ARCHES``. q8_0 falls back to F16 for tensors
    whose rows do not fill Q8_0 blocks, as the converter does. The base model (for the head
    counts) is ``base_dir``, else the adapter's ``base_model_name_or_path``."""
    from safetensors.torch import load_file

    with open(os.path.join(peft_dir, "adapter_config.json")) as handle:
        settings = json.load(handle)
    heads = _head_counts(base_dir or settings["base_model_name_or_path"])
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(os.path.basename(os.path.normpath(peft_dir)))
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(settings["lora_alpha"]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, tensor in sorted(load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()):
        name, half = _gguf_name(key)
        if half == "b" and arch in PERMUTED_ARCHES and name.split(".")[2] in ("attn_q", "attn_k"):
            tensor = _llama_permute(tensor, heads[0], heads[0] if name.split(".")[2] == "attn_q" else heads[1])
        _add_tensor(writer, f"{name}.lora_{half}", tensor.float().numpy(), GGUF_TYPES[dtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _head_counts(base: str) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads) of the base model, as the converter reads them."""
    from transformers import AutoConfig

    if os.path.isfile(base) and base.endswith(".gguf"):
        folder, name = os.path.split(base)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    else:
        config = AutoConfig.from_pretrained(base)
    return config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _gguf_name(key: str) -> tuple[str, str]:
    """``base_model.model.model.layers.1.mlp.up_proj.lora_B.weight`` -> ("blk.1.ffn_up.weight", "b")."""
    path, half = key.removeprefix("base_model.model.model.layers.").rsplit(".lora_", 1)
    layer, module = path.split(".", 1)
    return f"blk.{layer}.{GGUF_PARTS[module]}.weight", half.removesuffix(".weight").lower()


def _llama_permute(weights: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rows of q: n_head groups, of k: n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    """As the converter's prepare_tensors: quantize to ``qtype``, falling back to F16 (with its
    QuantError) when a row does not fill the type's blocks."""
    try:
        packed = gguf.quants.quantize(data, qtype)
    except gguf.QuantError:
        qtype = gguf.GGMLQuantizationType.F16
        packed = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, packed, raw_dtype=qtype)

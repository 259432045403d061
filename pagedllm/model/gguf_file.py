"""llama.cpp GGUF files: config and tokenizer from the metadata, tensors renamed to Hugging Face's
names and turned into torch tensors.

GGUF tensor names are mapped from llama.cpp's names; a name with no mapping is an error, since
dropping it could change the model.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import torch
from gguf import GGMLQuantizationType
from transformers import PreTrainedTokenizerFast

from pagedllm.logger import init_logger
from pagedllm.model.checkpoint import Checkpoint, check_architecture
from pagedllm.model.gguf_config import GLOBAL_NAMES, GGUFArchitecture, gguf_architecture, gguf_config, metadata
from pagedllm.model.gguf_moe import shape_moe_tensor
from pagedllm.model.gguf_reader import GGUFFile, GGUFTensor, read_gguf
from pagedllm.model.moe.packed_experts import PackedExpertWeight
from pagedllm.model.quantized.packed import DEQUANTIZED_TYPES, PACKED_TYPES, PackedWeight

logger = init_logger(__name__)

# The float types, the packed ones (kept in their blocks, with a kernel) and the block types only
# decoded at load. Importance-matrix (IQ*), ternary (TQ*) and FP4 types are left out on purpose:
# they are rare for these models and untested here.
_FLOAT_GGUF_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
SUPPORTED_GGUF_TYPES = _FLOAT_GGUF_TYPES | PACKED_TYPES | DEQUANTIZED_TYPES

_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def load_gguf(path: Path, dtype: torch.dtype, packed: bool = False) -> Checkpoint:
    """Load a llama.cpp GGUF file. Architecture, tensor names and types are checked before any
    tensor is decoded. ``packed``: 2-D weights of a ``PACKED_TYPES`` type stay in their blocks."""
    try:
        reader = read_gguf(path)
    except ValueError as error:
        raise ValueError(f"{str(path)!r} is not a valid GGUF file: {error}") from error
    architecture = metadata(reader, "general.architecture")
    layout = gguf_architecture(architecture)
    check_architecture(layout.model_type or architecture)
    if "tokenizer.ggml.tokens" not in reader.metadata:
        raise ValueError(f"{str(path)!r} has no tokenizer in its metadata")

    hf_names: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
            _raise_unsupported_type(tensor)
        if _rope_tensor_name(tensor.name) not in layout.rope_tensors:
            hf_names[tensor.name] = _hf_name(tensor.name, architecture, layout)

    rope_tensors = {_rope_tensor_name(t.name): dequantize_tensor(t, torch.float32) for t in reader.tensors
                    if t.name not in hf_names}
    config = gguf_config(reader, architecture, rope_tensors)
    state_dict = _read_weights(reader, hf_names, layout, config, dtype, packed)

    return Checkpoint(config=config, state_dict=state_dict, tokenizer=gguf_tokenizer(path, reader), path=str(path))


def gguf_tokenizer(path: Path, reader: GGUFFile) -> PreTrainedTokenizerFast:
    """The tokenizer in a GGUF file's metadata, with the file's chat template."""
    # PreTrainedTokenizerFast builds the tokenizer straight from the metadata. AutoTokenizer would
    # build the same one, but first rebuilds the config through transformers' slow GGUF path (~5 s).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    # transformers versions differ in whether they carry the template over; make sure it is there.
    chat_template = metadata(reader, "tokenizer.chat_template", None)
    if tokenizer.chat_template is None and chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _rope_tensor_name(gguf_name: str) -> str:
    """``rope_freqs.weight`` -> ``rope_freqs`` (what GGUF_ARCHITECTURES' rope_tensors list)."""
    return gguf_name.removesuffix(".weight")


def _read_weights(reader: GGUFFile, hf_names: dict[str, str], layout: GGUFArchitecture, config,
                  dtype: torch.dtype, packed: bool) -> dict[str, torch.Tensor | PackedWeight | PackedExpertWeight]:
    """Every named tensor, by Hugging Face name: decoded to ``dtype``, or kept in its blocks
    (2-D weights as ``PackedWeight``, merged expert stacks as ``PackedExpertWeight``)."""
    state_dict: dict[str, torch.Tensor | PackedWeight | PackedExpertWeight] = {}
    dequantized: set[str] = set()  # quantized types decoded at load although packing was asked for
    for tensor in reader.tensors:
        if tensor.name not in hf_names:
            continue
        name = hf_names[tensor.name]
        keep_packed = packed and tensor.tensor_type in PACKED_TYPES and len(tensor.shape) in (2, 3)  # not biases
        if keep_packed:
            kind = PackedWeight if len(tensor.shape) == 2 else PackedExpertWeight
            weights = kind.from_gguf(tensor, dtype)
        elif layout.norms_stored_plus_one and name.endswith("norm.weight"):
            weights = (dequantize_tensor(tensor, torch.float32) - 1).to(dtype)
        else:
            weights = shape_moe_tensor(name, dequantize_tensor(tensor, dtype))
        if packed and not keep_packed and tensor.tensor_type not in _FLOAT_GGUF_TYPES:
            dequantized.add(tensor.tensor_type.name)
        if layout.unpermute_qk and ".q_proj." in name:
            weights = unpermute_rope_rows(weights, config.num_attention_heads)
        elif layout.unpermute_qk and ".k_proj." in name:
            weights = unpermute_rope_rows(weights, config.num_key_value_heads)
        state_dict[name] = weights
    if dequantized:
        logger.info("GGUF types without a packed kernel, dequantized at load: %s", ", ".join(sorted(dequantized)))
    return state_dict


def _hf_name(gguf_name: str, architecture: str, layout: GGUFArchitecture) -> str:
    """The Hugging Face parameter name for a GGUF tensor name; ValueError for names with none."""
    if match := _GGUF_LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, suffix = match.groups()
        if part in layout.layer_names:
            return f"model.layers.{layer}.{layout.layer_names[part]}.{suffix}"
    elif match := _GGUF_GLOBAL_TENSOR.fullmatch(gguf_name):
        part, suffix = match.groups()
        if part in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[part]}.{suffix}"
    # Dropping a tensor we do not understand could yield a model that loads but computes nonsense.
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart for {architecture!r}")


def _raise_unsupported_type(tensor: GGUFTensor) -> None:
    supported = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
    raise ValueError(
        f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; supported: {supported}"
    )


def dequantize_tensor(tensor: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a torch tensor of `dtype` in Hugging Face (row-major, torch) shape."""
    if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
        _raise_unsupported_type(tensor)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32
    # F32 tensors come back as views of the read-only file mapping; copy those so the
    # state dict owns writable memory that outlives the reader.
    if not values.flags.writeable:
        values = values.copy()
    # GGUF lists dimensions fastest-varying first, torch the other way round.
    shape = tuple(int(size) for size in reversed(tensor.shape))
    return torch.from_numpy(values).reshape(shape).to(dtype)


def unpermute_rope_rows(weights: torch.Tensor | PackedWeight, n_head: int) -> torch.Tensor | PackedWeight:
    """Undo llama.cpp's q/k row permutation for llama checkpoints.

    llama.cpp's converter reorders each head's rows from Hugging Face's rotate-half rope layout to
    its interleaved one: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`. This is
    the inverse; it applies to weights, biases and packed weights (a permutation of block rows).
    """
    if isinstance(weights, PackedWeight):
        return weights.rows(unpermute_rope_rows(torch.arange(weights.shape[0]), n_head))
    rows, rest = weights.shape[0], weights.shape[1:]
    return weights.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(weights.shape)

"""A prompt's processed images as plain data, to cross a process boundary (the
engine-core messages, ``engine/core_messages.py``): each tensor as its dtype,
shape and raw bytes, beside the content hash and the placeholder range. The API
process runs the Hugging Face processor; the core rebuilds the tensors without
decoding or processing anything. Importing this module loads no torch."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange


class WireTensor(msgspec.Struct, array_like=True):
    dtype: str  # torch's name without "torch." (float32, bool, ...)
    shape: list[int]
    data: bytes


class WireFeature(msgspec.Struct, array_like=True):
    """``MultiModalFeature`` with its ``data`` (a dict of tensors) as ``WireTensor``s."""

    modality: str
    identifier: str
    offset: int
    length: int
    embed_token_id: int
    num_embeds: int
    tensors: dict[str, WireTensor]
    attends_both_ways: bool = False


def features_to_wire(features: list[MultiModalFeature]) -> list[WireFeature]:
    if not all(isinstance(f, MultiModalFeature) for f in features):
        raise ValueError("mm_features must be a list of MultiModalFeature (from ImagePromptProcessor.processed)")
    return [WireFeature(f.modality, f.identifier, f.placeholder.offset, f.placeholder.length, f.embed_token_id,
                        f.num_embeds, {name: _tensor_to_wire(value) for name, value in (f.data or {}).items()},
                        f.attends_both_ways)
            for f in features]


def features_from_wire(wire: list[WireFeature]) -> list[MultiModalFeature]:
    return [MultiModalFeature(w.modality, w.identifier, PlaceholderRange(w.offset, w.length), w.embed_token_id,
                              w.num_embeds, {name: _tensor_from_wire(value) for name, value in w.tensors.items()},
                              w.attends_both_ways)
            for w in wire]


def _tensor_to_wire(tensor: Any) -> WireTensor:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    # Bytes through uint8, so dtypes numpy lacks (bfloat16) travel too.
    return WireTensor(str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                      flat.view(torch.uint8).numpy().tobytes())


def _tensor_from_wire(wire: WireTensor) -> Any:
    import torch

    dtype = getattr(torch, wire.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"an image tensor of dtype {wire.dtype!r} cannot be rebuilt")
    raw = torch.frombuffer(bytearray(wire.data), dtype=torch.uint8) if wire.data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(wire.shape)

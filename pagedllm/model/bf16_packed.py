"""bf16 weights packed for VDPBF16PS: every matmul of a bf16 model on a CPU with
AVX-512 BF16 and no AMX (AMD Zen 4 and later, Intel Cooper Lake).

There oneDNN's bf16 GEMM and the small-batch kernel both read nn.Linear's
[out, in] layout and reach 55-85% of what the core's bf16 dot-product unit
can do; packed as [out / 16, in / 2, 16, 2] (``kernels/csrc/bf16_packed_linear.cpp``
says why) one kernel runs decode and prefill matmuls at ~90% of it (1.5x the
small-batch kernel at 8-20 rows, 1.1x oneDNN at prefill sizes: BENCHMARKS.md).

``pack_bf16_linears(model)`` runs once, after the model is loaded and on its
device: it swaps each ``Linear`` for a ``PackedBf16Linear`` whose weight is packed
in its own storage (the weights' memory stays the same), and gives a model with a tied
LM head a packed copy of the embedding (the embedding keeps its rows for the
lookup: one more vocabulary x hidden matrix, 56 MiB for SmolLM2-135M).

Not packed: fp32 and fp16 models, CUDA, a CPU with AMX (oneDNN's AMX GEMM is many
times faster at prefill than any VDPBF16PS kernel), a build without AVX-512
BF16, a layer whose out_features is not a multiple of 16 or whose in_features
is odd, and ``PAGEDLLM_BF16_PACKED=0``. Those keep ``Linear``.

A packed layer's weight is not in ``state_dict()`` (the packed weight is a
non-persistent buffer): pack after loading, never before.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.logger import init_logger
from pagedllm.model.layers import Linear

logger = init_logger(__name__)

_OUTPUTS_PER_VECTOR = 16


# 16-output blocks permuted per step of an in-place packing: a few MiB of scratch.
_BLOCKS_PER_CHUNK = 64


def _packed_shapes(weight: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the [out, in] weight as 16-row blocks of input pairs, the packed shape)."""
    out_features, in_features = weight.shape
    if not packable(weight):
        raise ValueError(f"a packed bf16 weight needs out_features % 16 == 0 and even in_features, "
                         f"not [{out_features}, {in_features}]")
    vectors = out_features // _OUTPUTS_PER_VECTOR
    return (vectors, _OUTPUTS_PER_VECTOR, in_features // 2, 2), (vectors, in_features // 2, _OUTPUTS_PER_VECTOR, 2)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in / 2, 16, 2]: element (o, i) lands at (o // 16, i // 2, o % 16, i % 2)."""
    blocks, _ = _packed_shapes(weight)
    return weight.reshape(blocks).permute(0, 2, 1, 3).contiguous()


def pack_bf16_weight_in_place(weight: torch.Tensor) -> torch.Tensor:
    """``pack_bf16_weight`` without a second copy of the weight: each 16-row block is
    permuted within its own bytes, a chunk of blocks at a time, and the result is a
    view of ``weight``'s storage. Safety rule: ``weight`` must be contiguous and
    nothing may read it as [out, in] afterwards (its bytes now hold the packed order)."""
    blocks_shape, packed_shape = _packed_shapes(weight)
    if not weight.is_contiguous():
        raise ValueError("pack_bf16_weight_in_place needs a contiguous weight")
    blocks, packed = weight.view(blocks_shape), weight.view(packed_shape)
    for start in range(0, blocks_shape[0], _BLOCKS_PER_CHUNK):
        chunk = slice(start, start + _BLOCKS_PER_CHUNK)  # the same bytes in both views
        packed[chunk].copy_(blocks[chunk].clone().permute(0, 2, 1, 3))
    return packed


def _owns_its_storage(weight: torch.Tensor) -> bool:
    """Contiguous and the whole of its storage: packing it in place disturbs no other tensor
    that views the same storage (a tied or sliced weight is copied instead)."""
    return weight.is_contiguous() and weight.storage_offset() == 0 and \
        weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def packable(weight: torch.Tensor) -> bool:
    """Whether ``pack_bf16_weight`` takes this weight's shape."""
    return weight.dim() == 2 and weight.shape[0] % _OUTPUTS_PER_VECTOR == 0 and weight.shape[1] % 2 == 0


class PackedBf16Linear(nn.Module):
    """``Linear``'s contract ([tokens, in] bf16 -> [tokens, out] bf16, optional ``bias``
    parameter) over a weight packed by ``pack_bf16_weight``. Safety rule: only built
    where ``bf16_packing_supported`` said yes (the kernel exists only there)."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None, in_place: bool = False) -> None:
        """``in_place``: pack ``weight``'s own storage (``pack_bf16_weight_in_place``'s
        safety rule applies) instead of a copy."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = pack_bf16_weight_in_place(weight) if in_place else pack_bf16_weight(weight)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = load_cpu_kernels()
        if x.dim() == 2 and x.stride(1) == 1:  # the model's case: [tokens, in], maybe a strided view
            return kernels.bf16_packed_linear(x, self.packed_weight, self.bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        out = kernels.bf16_packed_linear(rows, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def bf16_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_bf16_linears`` packs a model of ``dtype`` on ``device`` here."""
    if dtype != torch.bfloat16 or device.type != "cpu" or os.environ.get("PAGEDLLM_BF16_PACKED", "1") == "0":
        return False
    if torch.cpu._is_amx_tile_supported():
        return False
    kernels = load_cpu_kernels()
    return kernels is not None and kernels.bf16_packed_linear_available()


def pack_bf16_linears(model: nn.Module) -> int:
    """Swap every packable bf16 ``Linear`` of ``model`` (loaded, on its device) for a
    ``PackedBf16Linear``, and give a tied LM head a packed copy of the embedding;
    returns how many layers were packed (0 where ``bf16_packing_supported`` says no)."""
    parameter = next(model.parameters(), None)
    if parameter is None or not bf16_packing_supported(parameter.device, parameter.dtype):
        return 0
    # A weight that owns its storage (every loaded one) is packed in place: the model's
    # memory does not grow, not even by one layer. Names, not modules, are held, so a
    # copied weight is freed as soon as its packed copy replaces it.
    names = [name for name, module in model.named_modules()
             if type(module) is Linear and module.weight.dtype == torch.bfloat16 and packable(module.weight)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child)
        weight = dense.weight.detach()
        setattr(parent, child, PackedBf16Linear(weight, dense.bias, in_place=_owns_its_storage(weight)))
        del dense
    packed = len(names)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "tie_word_embeddings", False) and getattr(model, "lm_head", None) is None \
            and isinstance(embedding, nn.Embedding) and packable(embedding.weight):
        model.lm_head = PackedBf16Linear(embedding.weight.detach(), None)
        packed += 1
    if packed:
        logger.info("bf16 weights of %d layers packed for VDPBF16PS (PAGEDLLM_BF16_PACKED=0 keeps nn.Linear's layout)",
                    packed)
    return packed

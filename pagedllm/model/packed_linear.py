"""fp32 and bf16 weights packed for the C++ packed kernel: every matmul of an fp32
model on a CPU with AVX-512 (Intel and AMD), and of a bf16 model on one with
AVX-512 BF16 and no AMX (AMD Zen 4 and later).

There MKL's sgemm, oneDNN's bf16 GEMM and the small-batch kernel all read
nn.Linear's [out, in] layout and reach 40-85% of what the core's multipliers can
do; packed as [out / 16, in / g, 16, g] (g = 1 for fp32, 2 for bf16;
``kernels/csrc/packed_linear.cpp`` says why) one kernel runs decode and prefill
matmuls at ~90% of it (BENCHMARKS.md, "bf16 weights packed for VDPBF16PS",
"fp32 weights packed too" and, on an AMX Xeon, "Issue 22 on an Intel Xeon with AMX").

``pack_linears(model)`` runs once, after the model is loaded and on its device: it
swaps each ``Linear`` for a ``PackedLinear`` whose weight is packed in its own
storage (the weights' memory stays the same). A model whose LM head is tied to
the embedding gets the embedding packed as its head, and the embedding lookup
then reads its rows out of the packed layout (``PackedTiedEmbedding``): one
matrix still, in one order.

Not packed: fp16 models, CUDA, a build without AVX-512 (or AVX-512 BF16 for bf16),
a layer whose out_features is not a multiple of 16 (or, for bf16, whose
in_features is odd), and a bf16 model on a CPU with AMX unless asked for: there
oneDNN's AMX GEMM beats any VDPBF16PS kernel from ~10 rows up, 7-10x at prefill
sizes. ``PAGEDLLM_PACKED_LINEAR=0`` keeps ``Linear`` everywhere, ``=1`` packs bf16
on an AMX CPU too (``PAGEDLLM_BF16_PACKED=0``, this packing's first, bf16-only
switch, still keeps bf16 ``Linear``).

A packed layer's weight is not in ``state_dict()`` (the packed weight is a
non-persistent buffer): pack after loading, never before.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.kernels.cpu_features import cpu_has_amx
from pagedllm.logger import init_logger
from pagedllm.model.layers import Embedding, Linear, replace_submodule

logger = init_logger(__name__)

_OUTPUTS_PER_VECTOR = 16
_PACKED_DTYPES = (torch.float32, torch.bfloat16)

# 16-output blocks permuted per step of an in-place packing: a few MiB of scratch.
_BLOCKS_PER_CHUNK = 64


def _group(dtype: torch.dtype) -> int:
    """Consecutive inputs per lane of one weight vector: a bf16 pair for VDPBF16PS, one fp32."""
    return 2 if dtype == torch.bfloat16 else 1


def _packed_shapes(weight: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the [out, in] weight as 16-row blocks of input groups, the packed shape)."""
    out_features, in_features = weight.shape
    if not packable(weight):
        raise ValueError(f"a packed {weight.dtype} weight needs out_features % 16 == 0"
                         f"{' and even in_features' if _group(weight.dtype) == 2 else ''}, "
                         f"not [{out_features}, {in_features}]")
    vectors, group = out_features // _OUTPUTS_PER_VECTOR, _group(weight.dtype)
    return ((vectors, _OUTPUTS_PER_VECTOR, in_features // group, group),
            (vectors, in_features // group, _OUTPUTS_PER_VECTOR, group))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in / g, 16, g]: element (o, i) lands at (o // 16, i // g, o % 16, i % g)."""
    blocks, _ = _packed_shapes(weight)
    return weight.reshape(blocks).permute(0, 2, 1, 3).contiguous()


def pack_weight_in_place(weight: torch.Tensor) -> torch.Tensor:
    """``pack_weight`` without a second copy of the weight: each 16-row block is
    permuted within its own bytes, a chunk of blocks at a time, and the result is a
    view of ``weight``'s storage. Safety rule: ``weight`` must be contiguous and
    nothing may read it as [out, in] afterwards (its bytes now hold the packed order)."""
    blocks_shape, packed_shape = _packed_shapes(weight)
    if not weight.is_contiguous():
        raise ValueError("pack_weight_in_place needs a contiguous weight")
    blocks, packed = weight.view(blocks_shape), weight.view(packed_shape)
    for start in range(0, blocks_shape[0], _BLOCKS_PER_CHUNK):
        chunk = slice(start, start + _BLOCKS_PER_CHUNK)  # the same bytes in both views
        packed[chunk].copy_(blocks[chunk].clone().permute(0, 2, 1, 3))
    return packed


def _owns_its_storage(weight: torch.Tensor) -> bool:
    """Contiguous and the whole of its storage: packing it in place disturbs no other tensor
    that views the same storage (a sliced weight is copied instead)."""
    return weight.is_contiguous() and weight.storage_offset() == 0 and \
        weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def packable(weight: torch.Tensor) -> bool:
    """Whether ``pack_weight`` takes this weight's dtype and shape."""
    return weight.dtype in _PACKED_DTYPES and weight.dim() == 2 and \
        weight.shape[0] % _OUTPUTS_PER_VECTOR == 0 and weight.shape[1] % _group(weight.dtype) == 0


class PackedLinear(nn.Module):
    """``Linear``'s contract ([tokens, in] -> [tokens, out] in the weight's dtype,
    optional ``bias`` parameter) over a weight packed by ``pack_weight``. Safety rule:
    only built where ``packing_supported`` said yes (the kernel exists only there)."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None, in_place: bool = False) -> None:
        """``in_place``: pack ``weight``'s own storage (``pack_weight_in_place``'s
        safety rule applies) instead of a copy."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = pack_weight_in_place(weight) if in_place else pack_weight(weight)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = load_cpu_kernels()
        if x.dim() == 2 and x.stride(1) == 1:  # the model's case: [tokens, in], maybe a strided view
            return kernels.packed_linear(x, self.packed_weight, self.bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        out = kernels.packed_linear(rows, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def weight_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` (any shape) of the [out, in] weight, read out of the packed
        layout: [*indices.shape, in], exact (a gather, no arithmetic)."""
        flat = indices.reshape(-1)
        # Advanced indices around a slice put the indexed dimension first: [rows, in / g, g].
        rows = self.packed_weight[flat // _OUTPUTS_PER_VECTOR, :, flat % _OUTPUTS_PER_VECTOR]
        return rows.reshape(*indices.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedTiedEmbedding(nn.Module):
    """The token embedding of a model whose LM head is tied to it, once that head is a
    ``PackedLinear`` over the embedding's own storage: lookups read the head's packed
    rows, so the model holds the matrix once."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head.weight_rows(input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the packed LM head"


def _packing_switch() -> str:
    """``PAGEDLLM_PACKED_LINEAR``: "0" off, "1" on (bf16 on an AMX CPU too), anything else automatic."""
    return os.environ.get("PAGEDLLM_PACKED_LINEAR", "auto")


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` packs a model of ``dtype`` on ``device`` here."""
    switch = _packing_switch()
    if dtype not in _PACKED_DTYPES or device.type != "cpu" or switch == "0":
        return False
    if dtype == torch.bfloat16 and os.environ.get("PAGEDLLM_BF16_PACKED", "1") == "0":
        return False
    if switch != "1" and dtype == torch.bfloat16 and cpu_has_amx():
        return False
    kernels = load_cpu_kernels()
    return kernels is not None and kernels.packed_linear_available(dtype)


def packed_tiles_supported() -> bool:
    """Whether a GGUF weight's dequantized prefill tiles (``QuantizedLinear``) go through the
    packed fp32 kernel: where fp32 packs, except on a CPU with AMX unless asked for
    (``PAGEDLLM_PACKED_LINEAR=1``). There MKL's sgemm matches the packed kernel at prefill
    sizes (0.96x at 512 rows) and the mixed workload ran 1.04-1.05x faster on MKL tiles;
    the packed kernel's lead on that CPU is at decode sizes, which GGUF weights decode in
    their own blocks."""
    return packing_supported(torch.device("cpu"), torch.float32) and \
        (_packing_switch() == "1" or not cpu_has_amx())


def pack_linears(model: nn.Module) -> int:
    """Swap every packable ``Linear`` of ``model`` (loaded, on its device) for a
    ``PackedLinear``, and a tied embedding for a packed head it reads its rows from;
    returns how many layers were packed (0 where ``packing_supported`` says no)."""
    parameter = next(model.parameters(), None)
    if parameter is None or not packing_supported(parameter.device, parameter.dtype):
        return 0
    dtype = parameter.dtype
    # A weight that owns its storage (every loaded one) is packed in place: the model's
    # memory does not grow, not even by one layer. Names, not modules, are held, so a
    # copied weight is freed as soon as its packed copy replaces it.
    names = [name for name, module in model.named_modules()
             if type(module) is Linear and module.weight.dtype == dtype and packable(module.weight)]
    for name in names:
        dense = model.get_submodule(name)
        weight = dense.weight.detach()
        replace_submodule(model, name, PackedLinear(weight, dense.bias, in_place=_owns_its_storage(weight)))
        del dense
    packed = len(names)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "tie_word_embeddings", False) and getattr(model, "lm_head", None) is None \
            and type(embedding) is Embedding and embedding.weight.dtype == dtype and packable(embedding.weight):
        weight = embedding.weight.detach()
        model.lm_head = PackedLinear(weight, None, in_place=_owns_its_storage(weight))
        model.model.embed_tokens = PackedTiedEmbedding(model.lm_head)
        packed += 1
    if packed:
        logger.info("%s weights of %d layers packed for the C++ packed kernel "
                    "(PAGEDLLM_PACKED_LINEAR=0 keeps nn.Linear's layout)", str(dtype).removeprefix("torch."), packed)
    return packed


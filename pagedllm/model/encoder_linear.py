"""The encoder's linear layers through oneDNN on CPU, with their GELU or residual add fused.

PyTorch's ``F.linear`` runs fp32 on MKL's sgemm; oneDNN's matmul (``mkldnn::_linear_pointwise``,
the op PyTorch's own compiler emits for CPU linears) was 1.08-1.12x faster at the encoder's shapes
on an AMD EPYC (Zen 4, AVX-512), where MKL does not take its AVX-512 paths, and it applies the
GELU or the residual add while the output is still in cache instead of in a pass of their own
(docs/pooling.md, "Speed", has the figures). Results differ from MKL's only in the order of the
float sums (max 6e-6 at MiniLM's shapes). Elsewhere (another device, a dtype oneDNN's matmul does
not take here, ``torch.backends.mkldnn`` disabled) the plain PyTorch ops run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _onednn(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and torch.backends.mkldnn.enabled
            and torch.backends.mkldnn.is_available())


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(x @ weight.T + bias)``, the exact (erf) GELU of BERT's ``hidden_act: gelu``."""
    if _onednn(x):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "none")
    return F.gelu(F.linear(x, weight, bias))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``."""
    if _onednn(x):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias + residual`` (a post-norm layer's residual, added in the matmul's epilogue)."""
    if _onednn(x):
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    return F.linear(x, weight, bias) + residual

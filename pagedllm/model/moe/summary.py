"""What a model's start-up line says of its weights: bytes held, and the parameters a
token multiplies (a mixture of experts runs only top_k of each layer's experts per token)."""

from __future__ import annotations

from torch import nn

from pagedllm.model.moe.experts import Experts


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(all parameters, those active per token): each ``Experts`` stack counts its
    ``top_k / num_experts`` share as active, every other parameter in full (embeddings included)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    inactive = 0
    for module in model.modules():
        block = getattr(module, "routing", None)
        experts = getattr(module, "experts", None)
        if block is not None and isinstance(experts, Experts):
            stacked = sum(p.numel() for p in experts.parameters())
            inactive += stacked - stacked * block.top_k // experts.num_experts
    return total, total - inactive


def weights_line(model: nn.Module, weight_bytes: int) -> str:
    """e.g. ``weights: 1.20 GiB, 3.3B of 30.5B parameters active per token``."""
    total, active = parameter_counts(model)
    return f"weights: {weight_bytes / 2**30:.2f} GiB, {_count(active)} of {_count(total)} parameters active per token"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)

"""What a model's start-up line says of its weights: bytes held, and the parameters a
token multiplies (a mixture of experts runs only top_k of each layer's experts per token)."""

from __future__ import annotations

from torch import nn


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(all parameters, those active per token): each ``Experts`` stack counts its
    ``top_k / num_experts`` share as active, every other weight in full (embeddings included).
    A weight packed at load (``PackedLinear``, GGUF blocks, packed expert stacks) counts as its
    dense shape."""
    seen: set[int] = set()
    total = inactive = 0
    for module in model.modules():
        total += _weights_of(module, seen)
        routing, experts = getattr(module, "routing", None), getattr(module, "experts", None)
        if routing is not None and hasattr(experts, "num_experts"):  # Experts or PackedExperts
            stacked = getattr(experts, "num_weights", None) or sum(p.numel() for p in experts.parameters())
            inactive += stacked - stacked * routing.top_k // experts.num_experts
    return total, total - inactive


def _weights_of(module: nn.Module, seen: set[int]) -> int:
    """The parameters ``module`` holds itself (a tied one counted once), or the dense size of
    a packed linear's or packed embedding's weight, which are buffers: counted once per
    storage, since a tied GGUF head and its embedding share their blocks."""
    own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
    seen.update(id(p) for p in own)
    count = sum(p.numel() for p in own)
    if isinstance(getattr(module, "weight", None), nn.Parameter):
        return count
    storages = {b.untyped_storage().data_ptr() for b in module.buffers(recurse=False) if b.numel()}
    if storages and storages <= seen:
        return count
    seen.update(storages)
    if hasattr(module, "num_weights"):  # a packed expert stack
        return count + module.num_weights
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return count + module.in_features * module.out_features
    if hasattr(module, "blocks") and hasattr(module, "num_embeddings"):  # a GGUF embedding's packed rows
        return count + module.num_embeddings * module.embedding_dim
    return count


def weights_line(model: nn.Module, weight_bytes: int) -> str:
    """e.g. ``weights: 1.20 GiB, 3.3B of 30.5B parameters active per token``."""
    total, active = parameter_counts(model)
    return f"weights: {weight_bytes / 2**30:.2f} GiB, {_count(active)} of {_count(total)} parameters active per token"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)

"""LoRA adapters read from disk into ``LoRAWeights``, checked against the base model first.

Two formats: a Hugging Face PEFT folder (``peft_folder.py``) and a llama.cpp GGUF LoRA file
(``gguf_lora.py``). Both are checked here by the same rules, from their headers alone: an adapter
made for another model, for a layer the base lacks, or with a rank above ``max_lora_rank`` would
otherwise fail deep inside a forward pass, or run and compute nonsense. ``check_adapter`` runs the
checks without reading any tensor's data, so a request naming a bad adapter is refused before
anything is paged in; ``read_adapter`` runs the same checks, then reads the tensors.

Every refusal is a ``ValueError`` that names the file and what to change.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.lora.weights import LORA_MODULES, LoRAWeights
from pagedllm.lora.page_layout import projection_shapes

# (layer index, module name) -> {"A": shape, "B": shape}, in torch order ([rank, in] and [out, rank]).
AdapterShapes = dict[tuple[int, str], dict[str, tuple[int, ...]]]

# Modules adapters commonly target that this engine does not serve, with what they are.
_UNSERVED_HINTS = {
    "lm_head": "the output projection",
    "embed_tokens": "the token embedding",
}


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter is, as its headers say: enough to admit or refuse it before reading it."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]


def read_adapter(path: str, config: Any, max_lora_rank: int) -> LoRAWeights:
    """The adapter at ``path`` (a PEFT folder or a ``.gguf`` file), checked against the base
    model's ``config``, as fp32 CPU tensors."""
    if _format_of(path) == "peft":
        from pagedllm.lora.peft_folder import read_peft_folder

        return read_peft_folder(os.fspath(path), config, max_lora_rank)
    from pagedllm.lora.gguf_lora import read_gguf_lora

    return read_gguf_lora(os.fspath(path), config, max_lora_rank)


def check_adapter(path: str, config: Any, max_lora_rank: int) -> AdapterInfo:
    """The checks ``read_adapter`` makes, from the file headers only (no tensor data read)."""
    if _format_of(path) == "peft":
        from pagedllm.lora.peft_folder import check_peft_folder

        return check_peft_folder(os.fspath(path), config, max_lora_rank)
    from pagedllm.lora.gguf_lora import check_gguf_lora

    return check_gguf_lora(os.fspath(path), config, max_lora_rank)


def _format_of(path: str) -> str:
    """The format at ``path``: "peft" (a folder) or "gguf" (a ``.gguf`` file); anything else is
    refused here, with a hint, before either reader opens it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "peft"
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf"
        name = os.path.basename(path)
        if name.startswith("adapter_"):
            raise ValueError(f"LoRA adapter {path!r} is one file of a PEFT folder; pass the folder itself "
                             f"({os.path.dirname(path) or '.'!r})")
        raise ValueError(f"LoRA adapter {path!r} is neither a PEFT folder nor a llama.cpp .gguf LoRA file")
    raise ValueError(f"LoRA adapter {path!r}: no such folder or file")


def check_target_module(module: str, source: str) -> None:
    """Refuse, by name, a module outside ``LORA_MODULES`` (lm_head, embed_tokens, ...): serving
    the adapter without it would silently compute another model than the one trained."""
    if module in LORA_MODULES:
        return
    what = f" ({_UNSERVED_HINTS[module]})" if module in _UNSERVED_HINTS else ""
    raise ValueError(f"{source} targets {module!r}{what}, which is not served: only {', '.join(LORA_MODULES)} "
                     f"may be targeted; train the adapter without {module!r}")


def check_shapes(shapes: AdapterShapes, config: Any, max_lora_rank: int, source: str) -> int:
    """Every (layer, module) pair checked against the base model; returns the adapter's one rank.

    Both formats describe their tensors as ``AdapterShapes`` and come through here, so a PEFT
    folder and a GGUF file are held to exactly the same rules."""
    if not shapes:
        raise ValueError(f"{source} holds no LoRA tensors")
    features = projection_shapes(config)
    num_layers = config.num_hidden_layers
    for _, module in shapes:
        check_target_module(module, source)
    ranks: set[int] = set()
    for layer, module in sorted(shapes, key=lambda key: (key[0], LORA_MODULES.index(key[1]))):
        pair = shapes[(layer, module)]
        where = f"{source}: layer {layer} {module}"
        if layer >= num_layers:
            raise ValueError(f"{where}: the base model has {num_layers} layers (0..{num_layers - 1}); "
                             "the adapter was made for another model")
        for half, other in (("A", "B"), ("B", "A")):
            if half not in pair:
                raise ValueError(f"{where} has lora_{other} without its lora_{half}; the file is incomplete")
        ranks.add(_check_pair(where, pair["A"], pair["B"], features[module]))
    if len(ranks) > 1:
        raise ValueError(f"{source} mixes ranks {sorted(ranks)}; one rank per adapter is served")
    rank = ranks.pop()
    if rank > max_lora_rank:
        raise ValueError(f"{source}: rank {rank} exceeds max_lora_rank {max_lora_rank}; raise max_lora_rank")
    return rank


def _check_pair(where: str, a: tuple[int, ...], b: tuple[int, ...], in_out: tuple[int, int]) -> int:
    """One module's A [rank, in] and B [out, rank] against the base's (in, out); returns the rank."""
    in_features, out_features = in_out
    if len(a) != 2 or len(b) != 2:
        raise ValueError(f"{where}: lora_A {list(a)} and lora_B {list(b)} must both be matrices")
    rank = a[0]
    if rank < 1 or b[1] != rank:
        raise ValueError(f"{where}: lora_A {list(a)} and lora_B {list(b)} disagree on the rank")
    if a[1] != in_features:
        raise ValueError(f"{where}: lora_A is {list(a)}, but the base model's projection takes "
                         f"{in_features} input features; the adapter was made for another model")
    if b[0] != out_features:
        raise ValueError(f"{where}: lora_B is {list(b)}, but the base model's projection has "
                         f"{out_features} output features; the adapter was made for another model")
    return rank


def adapter_info(shapes: AdapterShapes, rank: int, scaling: float) -> AdapterInfo:
    """The ``AdapterInfo`` of checked shapes (target modules in ``LORA_MODULES`` order, as
    ``LoRAWeights.target_modules`` lists them)."""
    present = {module for _, module in shapes}
    return AdapterInfo(rank=rank, scaling=float(scaling),
                       target_modules=tuple(m for m in LORA_MODULES if m in present))


def adapter_fingerprint(path: str) -> str:
    """A digest of the adapter's bytes (every file of a PEFT folder, in name order, or the
    GGUF file): it joins the adapter's name in the prefix-cache key. Reads the files once
    more, in 1 MiB chunks; called once per adapter name."""
    files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path)
                                                        if os.path.isfile(os.path.join(path, f)))
    digest = hashlib.sha256()
    for file in files:
        digest.update(os.path.basename(file).encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]

"""Pooling over packed hidden states and the sentence-transformers modules after it (Dense, Normalize).

Each pooling mode is computed over the packed ``[T, H]`` hidden states with segment
operations (index_add, scatter_reduce), as sentence-transformers' own unpadded path
does, never by padding back to ``[B, L, H]``. A sequence's leading ``prompt_lens[i]``
tokens (its instruction prompt) are left out when the Pooling config has
``include_prompt: false``; positions keep their original numbers for ``weightedmean``.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagedllm.model.bert import PackedBatch
from pagedllm.pooling.st_folder import DenseConfig, PoolingConfig


def pool(hidden: torch.Tensor, batch: PackedBatch, prompt_lens: list[int], config: PoolingConfig) -> torch.Tensor:
    """One vector per sequence, ``[B, H * len(config.modes)]``: each mode's vector, concatenated."""
    num_seqs, hidden_size = len(batch.seq_lens), hidden.shape[1]
    lens = torch.tensor(batch.seq_lens)
    starts = batch.starts()
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lens)
    prompt = torch.tensor(prompt_lens) if not config.include_prompt else torch.zeros(num_seqs, dtype=torch.long)
    keep = batch.positions >= prompt[seq_ids]
    kept, kept_ids = (hidden, seq_ids) if bool(keep.all()) else (hidden[keep], seq_ids[keep])
    counts = torch.clamp((lens - prompt).clamp(min=0).to(hidden.dtype), min=1e-9)[:, None]
    outputs = []
    for mode in config.modes:
        if mode == "cls":
            # The first token after the prompt (the first token when the prompt is all there is).
            outputs.append(hidden[starts + torch.where(lens > prompt, prompt, 0)])
        elif mode == "lasttoken":
            outputs.append(hidden[starts + lens - 1])
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = torch.zeros(num_seqs, hidden_size, dtype=hidden.dtype).index_add_(0, kept_ids, kept)
            outputs.append(total / (counts if mode == "mean" else counts.sqrt()))
        elif mode == "max":
            init = torch.full((num_seqs, hidden_size), float("-inf"), dtype=hidden.dtype)
            outputs.append(init.scatter_reduce(0, kept_ids[:, None].expand(-1, hidden_size), kept, reduce="amax"))
        elif mode == "weightedmean":
            weights = (batch.positions[keep] + 1).to(hidden.dtype)[:, None]
            total = torch.zeros(num_seqs, hidden_size, dtype=hidden.dtype).index_add_(0, kept_ids, kept * weights)
            weight_sum = torch.zeros(num_seqs, 1, dtype=hidden.dtype).index_add_(0, kept_ids, weights)
            outputs.append(total / weight_sum.clamp(min=1e-9))
        else:
            raise ValueError(f"pooling mode {mode!r} is not supported")
    return torch.cat(outputs, dim=-1)


def activation_module(path: str) -> torch.nn.Module:
    """A Dense module's activation from its dotted path; like sentence-transformers without
    trust_remote_code, only a ``torch.`` module class is accepted."""
    module_name, _, class_name = path.rpartition(".")
    activation = getattr(importlib.import_module(module_name), class_name, None) if path.startswith("torch.") else None
    if not (isinstance(activation, type) and issubclass(activation, torch.nn.Module)):
        raise ValueError(f"Dense activation_function {path!r} is not supported: it must name a torch.nn module class")
    return activation()


class Dense:
    """sentence-transformers' Dense: ``activation(linear(x))`` (+ the input, or its projection, if residual)."""

    def __init__(self, config: DenseConfig, dtype: torch.dtype) -> None:
        safetensors_file, bin_file = config.folder / "model.safetensors", config.folder / "pytorch_model.bin"
        if safetensors_file.is_file():
            weights = load_file(str(safetensors_file))
        elif bin_file.is_file():
            weights = torch.load(bin_file, map_location="cpu", weights_only=True)
        else:
            raise ValueError(f"{str(config.folder)!r}: a Dense module needs model.safetensors or pytorch_model.bin")
        self.weight = weights["linear.weight"].to(dtype)
        if tuple(self.weight.shape) != (config.out_features, config.in_features):
            raise ValueError(f"{str(config.folder)!r}: linear.weight is {tuple(self.weight.shape)}, its config says "
                             f"{(config.out_features, config.in_features)}")
        self.bias = weights["linear.bias"].to(dtype) if config.bias else None
        self.activation = activation_module(config.activation)
        self.use_residual = config.use_residual
        # A residual of another width goes through its own bias-free projection.
        self.residual_weight = (weights["residual.weight"].to(dtype)
                                if config.use_residual and config.in_features != config.out_features else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(F.linear(x, self.weight, self.bias))
        if not self.use_residual:
            return out
        return out + (x if self.residual_weight is None else F.linear(x, self.residual_weight))

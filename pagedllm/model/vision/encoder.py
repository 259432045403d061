"""The pre-norm transformer encoder CLIP and SigLIP towers share: LayerNorm, bidirectional
attention with biased q/k/v/out projections, LayerNorm, a two-layer GELU MLP. Parameter
names match Hugging Face's (``encoder.layers.N.self_attn.q_proj`` ...; q/k/v are fused
on loading by ``llama.fuse_projections``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's sigmoid approximation of GELU (Hugging Face's ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


# Hugging Face's ``hidden_act`` names the towers use -> the function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``hidden_act`` names; ValueError naming the supported ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        # Hugging Face's q/k/v_proj, fused on loading (``llama.fuse_projections``): one matmul.
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, dim = hidden.shape
        q, k, v = (part.view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for part in self.qkv_proj(hidden).split(dim, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, dim))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.act = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden), mask)
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    """``num_layers`` of the tower's layers (all of them by default: a model that reads an
    earlier layer's output builds only the layers up to it)."""

    def __init__(self, config: PretrainedConfig, num_layers: int | None = None) -> None:
        super().__init__()
        count = config.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(count))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None,
                keep: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The last layer's output, and the hidden state at each index in ``keep``
        (Hugging Face's ``hidden_states`` numbering: 0 is the input, i the output of layer i)."""
        kept = {0: hidden} if 0 in keep else {}
        for index, layer in enumerate(self.layers, start=1):
            hidden = layer(hidden, mask)
            if index in keep:
                kept[index] = hidden
        return hidden, kept

"""The CLIP vision transformer (LLaVA's tower): a class embedding before the patches,
learned positions for a fixed image size, a LayerNorm before the encoder
(``pre_layrnorm``, Hugging Face's spelling). Parameter names match Hugging Face's
``CLIPVisionModel``; the pooled head (``post_layernorm`` on the class row) is not
built: LLaVA reads hidden states of the encoder."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model.vision.encoder import VisionEncoder


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2 + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, 1 + patches, width]: the class row, then the patches in raster order."""
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"the CLIP tower takes {self.image_size}x{self.image_size} images, got {height}x{width}; "
                             "the checkpoint's image processor must crop to the tower's image_size")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        classes = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([classes, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTransformer(nn.Module):
    """The embeddings, ``pre_layrnorm`` and the first ``num_layers`` encoder layers (the ones a
    model reads up to)."""

    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states numbered ``layers`` (Hugging Face's ``hidden_states``: 0 is the
        encoder's input, i the output of layer i), in that order."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        _, kept = self.encoder(hidden, keep=frozenset(layers))
        return [kept[layer] for layer in layers]

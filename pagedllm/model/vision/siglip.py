"""The SigLIP vision transformer: as Idefics3 / SmolVLM use it, patches of images of
variable size, each patch's position embedding bucketed from its fractional place in
the image (NaViT's "patch n' pack"), bidirectional attention over the real patches;
as Gemma 3 uses it (Hugging Face's ``SiglipVisionModel``), whole images of the tower's
size, patch i at position i. Parameter names match Hugging Face's ``model.vision_model``."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model.vision.encoder import VisionEncoder


class VisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, padding="valid")
        self.num_patches_per_side = config.image_size // config.patch_size
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        """Patch embeddings plus positions: a real patch at fraction (h, w) of its
        image's real patches takes the position of the bucket that fraction falls in
        (Hugging Face's arithmetic, in float32); padding patches take position 0.
        Without a ``patch_mask`` every patch is real and patch i takes position i."""
        batch = pixel_values.shape[0]
        embeddings = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if patch_mask is None:
            if embeddings.shape[1] != self.position_embedding.num_embeddings:
                raise ValueError(f"the SigLIP tower takes images of {self.num_patches_per_side * self.patch_size} "
                                 f"pixels a side, got {tuple(pixel_values.shape[-2:])}")
            return embeddings + self.position_embedding.weight
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=pixel_values.device)
        rows, cols = patch_mask.shape[1:]

        def buckets(count: torch.Tensor, size: int) -> torch.Tensor:
            fractions = torch.arange(size, device=pixel_values.device, dtype=torch.float32)[None, :] / count[:, None]
            return torch.bucketize(torch.clamp(fractions, max=1.0 - 1e-6), boundaries, right=True)

        ids = (buckets(patch_mask[:, :, 0].sum(1), rows)[:, :, None] * side
               + buckets(patch_mask[:, 0, :].sum(1), cols)[:, None, :])
        ids = torch.where(patch_mask.reshape(batch, -1), ids.reshape(batch, -1), 0)
        return embeddings + self.position_embedding(ids)


class SiglipVisionTransformer(nn.Module):
    """Tiles of one image in, one hidden state per patch out (after the final LayerNorm)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``pixel_values`` [tiles, 3, H, W]; ``pixel_mask`` [tiles, H, W], true on real
        pixels: a patch is real when any of its pixels is; attention reads only real patches
        (None: every pixel is real)."""
        if pixel_mask is None:
            hidden, _ = self.encoder(self.embeddings(pixel_values, None))
            return self.post_layernorm(hidden)
        size = self.patch_size
        patch_mask = pixel_mask.unfold(1, size, size).unfold(2, size, size).sum(dim=(-1, -2)) > 0
        hidden = self.embeddings(pixel_values, patch_mask)
        hidden, _ = self.encoder(hidden, patch_mask.reshape(patch_mask.shape[0], 1, 1, -1))
        return self.post_layernorm(hidden)


class SiglipHiddenStates(nn.Module):
    """The embeddings and the first ``num_layers`` encoder layers of a SigLIP tower over whole
    images (LLaVA's reading of it: hidden states, never the final LayerNorm)."""

    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states numbered ``layers`` (Hugging Face's ``hidden_states``), in that order."""
        _, kept = self.encoder(self.embeddings(pixel_values, None), keep=frozenset(layers))
        return [kept[layer] for layer in layers]

"""Idefics3 (and SmolVLM, whose checkpoints are Idefics3's): a SigLIP vision tower,
a pixel-shuffle connector into the decoder's width, and a Llama decoder
(``model/vision/family.py``). ``embed_image`` runs the tower and the connector on
one image's tiles; the runner puts its rows at the image's placeholder tokens, as
Hugging Face's ``inputs_merger`` does."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.vision.family import VisionLanguageCausalLM
from pagedllm.model.vision.siglip import SiglipVisionTransformer


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Idefics3Connector(nn.Module):
    """Pixel shuffle (each ``scale x scale`` square of patches becomes one row, ``scale^2``
    times as wide: fewer image tokens), then a linear map into the decoder's width."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.modality_projection = ModalityProjection(config.vision_config.hidden_size * self.scale**2,
                                                      config.text_config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tiles, patches, width] -> [tiles, patches / scale^2, decoder width], in Hugging Face's order."""
        tiles, patches, width = hidden.shape
        side, scale = int(patches**0.5), self.scale
        x = hidden.view(tiles, side, side // scale, width * scale).permute(0, 2, 1, 3)
        x = x.reshape(tiles, side // scale, side // scale, width * scale**2).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(tiles, patches // scale**2, width * scale**2))


class Idefics3ForConditionalGeneration(VisionLanguageCausalLM):
    """The Llama decoder (``model``, ``lm_head``) plus ``vision_model`` and ``connector``."""

    vision_language_types = ("idefics3",)
    renames = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
               ("model.connector.", "connector."))

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        whole = config.vision_language_config
        self.vision_model = SiglipVisionTransformer(whole.vision_config)
        self.connector = Idefics3Connector(whole)

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's decoder-width rows, in placeholder order (its tiles', then its global view's)."""
        weight = self.connector.modality_projection.proj.weight
        pixels = data["pixel_values"].to(weight.device, weight.dtype)
        mask = data["pixel_attention_mask"].to(weight.device, torch.bool)
        features = self.connector(self.vision_model(pixels, mask))
        return features.reshape(-1, features.shape[-1])

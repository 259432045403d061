"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``, llava-1.6): LLaVA's tower and projector
(``model/llava.py``) over "anyres" tiles. The processor cuts an image into a grid of
tower-sized tiles at the best of ``image_grid_pinpoints`` plus a downscaled whole view;
``embed_image`` gives the whole view's rows, then the grid's rows re-assembled into one
feature map, cropped back to the image's aspect ratio (the resize padding removed), with
``image_newline`` after each row of it: Hugging Face's ``pack_image_features``
("spatial_unpad"), whose grid arithmetic (``get_anyres_image_grid_shape``, ``unpad_image``)
is called from transformers itself so the shapes cannot drift."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.llava import LlavaForConditionalGeneration


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA's modules plus ``image_newline`` (one decoder-width row)."""

    vision_language_types = ("llava_next",)
    renames = LlavaForConditionalGeneration.renames + (("model.image_newline", "image_newline"),)

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        whole = config.vision_language_config
        self.grid_pinpoints = [list(pinpoint) for pinpoint in whole.image_grid_pinpoints]
        self.tile_size = whole.vision_config.image_size
        self.tile_side = whole.vision_config.image_size // whole.vision_config.patch_size
        self.image_newline = nn.Parameter(torch.empty(config.hidden_size))

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows: its whole view's, then its grid's (cropped, a newline row after each
        feature row). The processor always gives the whole view and at least one grid tile."""
        # Imported here: transformers' modeling module pulls in optional GPU libraries (triton),
        # which a text-only CPU engine must never import (tests/engine/test_cpu_engine_imports.py).
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        features = self.tile_features(data["pixel_values"])
        newline = self.image_newline.to(features.dtype)
        size = data["image_sizes"]  # (height, width) of the image as given
        grid_height, grid_width = get_anyres_image_grid_shape(size, self.grid_pinpoints, self.tile_size)
        side = self.tile_side
        grid = features[1:].view(grid_height, grid_width, side, side, -1).permute(4, 0, 2, 1, 3)
        grid = unpad_image(grid.flatten(1, 2).flatten(2, 3), size)
        grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1)], dim=-1)
        return torch.cat([features[0], grid.flatten(1, 2).transpose(0, 1)])

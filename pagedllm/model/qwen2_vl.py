"""Qwen2-VL (``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL (the same with its own
vision tower): the Qwen2-VL vision transformer
(``model/vision/qwen2_vl.py``: images at their own resolution, 2x2 patches merged into one
row) and a Qwen2 decoder with multimodal rotary positions (M-RoPE): each head's rotary
frequencies are split into ``mrope_section`` groups that rotate by a token's time, height and
width position (``model/rotary.py``). A prompt's positions come from its images' grids
(``mrope_prompt_positions``, which the runner asks once per sequence: ``worker/mrope.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.llama import QWEN2_DECODER_TYPES
from pagedllm.model.vision.family import VisionLanguageCausalLM
from pagedllm.model.vision.qwen2_vl import Qwen25VisionTransformer, Qwen2VisionTransformer
from pagedllm.model.mrope import mrope_prompt_positions


class Qwen2VLForConditionalGeneration(VisionLanguageCausalLM):
    """The Qwen2 decoder (``model``, ``lm_head``) plus ``visual``."""

    vision_language_types = ("qwen2_vl",)
    model_types = QWEN2_DECODER_TYPES
    # Hugging Face 5's names; the hub's layout (``model.layers``, ``visual.``) is this module's.
    renames = (("model.language_model.", "model."), ("model.visual.", "visual."))
    tower: type[Qwen2VisionTransformer] = Qwen2VisionTransformer

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        whole = config.vision_language_config
        section = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
        if section is None or 2 * sum(section) != self.model.layers[0].self_attn.rotary.rot_dim:
            raise ValueError(f"{whole.model_type}'s rope_parameters need an mrope_section summing to half the "
                             f"rotary dimensions, got {section}")
        if self.rope_depends_on_length:
            raise ValueError("M-RoPE with a length-dependent rope_type is not supported; use rope_type 'default'")
        self.merge = whole.vision_config.spatial_merge_size
        self.visual = self.tower(whole.vision_config)

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows, in placeholder order (its merged patches, raster order)."""
        return self.visual(data["pixel_values"], [int(n) for n in data["image_grid_thw"]])

    def mrope_prompt_positions(self, num_tokens: int, mm_features: Any) -> tuple[np.ndarray, int]:
        """([3, num_tokens] rotary positions, delta) of a prompt with these images (``worker/mrope.py``)."""
        images = []
        for feature in mm_features:
            frames, height, width = (int(n) for n in feature.data["image_grid_thw"])
            images.append((feature.placeholder.offset, frames, height // self.merge, width // self.merge))
        return mrope_prompt_positions(num_tokens, images)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's decoder and positions; Qwen2.5-VL's window-attention tower."""

    vision_language_types = ("qwen2_5_vl",)
    tower = Qwen25VisionTransformer

"""Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``, ``model_type``
``gemma3``): a SigLIP tower over whole images of its size, a projector that averages
the patch grid down to ``mm_tokens_per_image`` rows, normalises them (Gemma's RMSNorm)
and maps them into the decoder's width, and the Gemma 3 text decoder
(``model/gemma.py``, sliding-window layers included).

Two things differ from the Llama-decoder families, each as Hugging Face computes it:
- the image rows replace the placeholder tokens' embeddings after the text embedding's
  sqrt(hidden) scaling (``Gemma3TextScaledWordEmbedding`` scales token embeddings
  only; ``GemmaForCausalLM.forward``), so they enter the decoder unscaled;
- each run of an image's tokens attends to itself both ways inside the causal decoder
  (``token_type_ids``' groups, ``create_masks_for_vision_model``): full layers see
  causal OR same-image, sliding layers the same AND their window. The processor marks
  its images ``attends_both_ways``: the runner hands the attention those runs
  (``PrefillSpan.image_groups``) and the scheduler never ends a prefill chunk inside one.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.gemma import GemmaForCausalLM, GemmaRMSNorm
from pagedllm.model.llava import LlavaForConditionalGeneration
from pagedllm.model.vision.family import VisionLanguageCausalLM
from pagedllm.model.vision.siglip import SiglipVisionTransformer


class Gemma3MultiModalProjector(nn.Module):
    """[images, patches, vision width] -> [images, mm_tokens_per_image, decoder width]:
    average pooling of the square patch grid, RMSNorm, a matmul by ``mm_input_projection_weight``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side divides "
                             f"the tower's {self.patches_per_side} patches a side")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        images, _, width = features.shape
        grid = features.transpose(1, 2).reshape(images, width, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        projected = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)
        return projected.type_as(features)


class Gemma3ForConditionalGeneration(VisionLanguageCausalLM, GemmaForCausalLM):
    """The Gemma 3 decoder (``model``, ``lm_head``) plus ``vision_tower`` and ``multi_modal_projector``."""

    model_types = ("gemma3_text",)
    vision_language_types = ("gemma3",)
    # Hugging Face 5's in-memory names, the hub's layout and what ``save_pretrained`` writes: LLaVA's.
    renames = LlavaForConditionalGeneration.renames
    # Each image's tokens attend to each other both ways (``ImagePromptProcessor`` marks its features).
    attends_images_both_ways = True

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        self.vision_tower = SiglipVisionTransformer(self.tower_config(config, ("siglip_vision_model",), "Gemma 3"))
        self.multi_modal_projector = Gemma3MultiModalProjector(config.vision_language_config)

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's ``mm_tokens_per_image`` decoder-width rows, in raster order of the pooled grid."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = data["pixel_values"].to(weight.device, weight.dtype)
        features = self.multi_modal_projector(self.vision_tower(pixels.reshape(-1, *pixels.shape[-3:])))
        return features.reshape(-1, features.shape[-1])

    def unused_weight(self, name: str) -> bool:
        """The tower's pooling head (``vision_use_head``) and an old checkpoint's ``position_ids``
        buffer: Gemma 3 reads the tower's last hidden state."""
        return name.startswith("vision_tower.head.") or name == "vision_tower.embeddings.position_ids"

"""Preprocessing of a prompt with images through the checkpoint's own Hugging Face
processor (``AutoProcessor``), so resizing, tiling, normalisation and the expansion
of each image placeholder into its tokens are exactly the model's.

The prompt's text names each image where it goes with the processor's image token
(``<image>`` for Idefics3 / SmolVLM and LLaVA), as the chat template writes it. The
processor expands the text; each image is also processed alone (one placeholder and
that image), so its tensors (what the encoder reads and the encoder cache keys by
content) depend on that image only, and the image tokens that placeholder became are
how many of the prompt's image tokens, in prompt order, the image fills: the
family's rule, as its own processor writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pagedllm.multimodal.hashing import image_content_hash
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange


class ImagePromptProcessor:
    """Turns ``(text, images)`` into prompt token ids and one ``MultiModalFeature`` per image."""

    # The processor's outputs an encoder reads (those a family's processor gives).
    TENSORS = ("pixel_values", "pixel_attention_mask", "image_sizes")

    def __init__(self, hf_processor: Any, image_token_id: int) -> None:
        self.hf = hf_processor
        self.image_token = hf_processor.image_token
        self.image_token_id = image_token_id

    @classmethod
    def for_checkpoint(cls, path: str, image_token_id: int) -> ImagePromptProcessor:
        from transformers import AutoProcessor

        if not any((Path(path) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
            raise ValueError(f"{path!r} is a vision-language checkpoint without processor_config.json: "
                             "its images cannot be processed as the model expects; add the processor's files")
        return cls(AutoProcessor.from_pretrained(path, local_files_only=True), image_token_id)

    def process(self, text: str, images: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids of ``text`` with each image token expanded, and the images' features.
        ``ValueError`` naming the problem: not PIL images, or as many image tokens in
        the text as images."""
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for index, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data['image'][{index}] is a {type(image).__name__}; pass PIL images")
        if text.count(self.image_token) != len(images):
            raise ValueError(f"the prompt has {text.count(self.image_token)} {self.image_token!r} placeholders for "
                             f"{len(images)} images; put one where each image goes")
        rgb = [image if image.mode == "RGB" else image.convert("RGB") for image in images]
        token_ids = self.hf(text=[text], images=[rgb] if rgb else None)["input_ids"][0]
        token_ids = [int(t) for t in token_ids]
        positions = np.flatnonzero(np.asarray(token_ids) == self.image_token_id)
        features, used = [], 0
        for image in rgb:
            alone = self.hf(text=[self.image_token], images=[[image]], return_tensors="pt")
            data = {name: value[0] for name, value in alone.items() if name in self.TENSORS}
            count = int((alone["input_ids"][0] == self.image_token_id).sum())
            mine = positions[used:used + count]
            if len(mine) != count:
                raise ValueError(f"the processor wrote {len(positions)} image tokens, fewer than the images need")
            used += count
            placeholder = PlaceholderRange(int(mine[0]), int(mine[-1]) + 1 - int(mine[0]))
            features.append(MultiModalFeature("image", image_content_hash(image), placeholder, self.image_token_id,
                                              count, data))
        if used != len(positions):
            raise ValueError(f"the prompt has {len(positions) - used} image tokens no image fills; "
                             "write images only through multi_modal_data and the image placeholder")
        return token_ids, features


def image_prompt_processor_for(model_config: Any, path: str) -> ImagePromptProcessor | None:
    """The processor of a vision-language checkpoint (its decoder config carries the whole
    config: ``model/vision/config.py``); None for a text-only model."""
    whole = getattr(model_config, "vision_language_config", None)
    return None if whole is None else ImagePromptProcessor.for_checkpoint(path, whole.image_token_id)

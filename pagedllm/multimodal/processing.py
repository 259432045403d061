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

from pagedllm.config.multimodal import MultiModalConfig
from pagedllm.multimodal.hashing import image_content_hash
from pagedllm.multimodal.grid_processor import GRID_PROCESSOR_TYPES, GridImageProcessor
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedllm.multimodal.media import load_image


class ImagePromptProcessor:
    """Turns ``(text, images)`` into prompt token ids and one ``MultiModalFeature`` per image.

    ``config``: the per-prompt limits, and where images named by URL may come from
    (``load``). It pickles whole: an API process in front of an engine-core process
    processes the images with the core's own copy.
    """

    # The processor's outputs an encoder reads (those a family's processor gives).
    TENSORS = ("pixel_values", "pixel_attention_mask", "image_sizes", "image_grid_thw")

    def __init__(self, hf_processor: Any, image_token_id: int, config: MultiModalConfig | None = None,
                 attends_both_ways: bool = False) -> None:
        self.hf = hf_processor
        # The model attends both ways over each image's tokens (Gemma 3): its features say so.
        self.attends_both_ways = attends_both_ways
        self.image_token = hf_processor.image_token
        self.image_token_id = image_token_id
        self.config = config or MultiModalConfig()
        # The processor's chat template places images ({"type": "image"} content parts).
        self.chat_template: str | None = getattr(hf_processor, "chat_template", None)

    def load(self, url: str) -> Image.Image:
        """The image a request names by URL (``multimodal/media.py``'s rules)."""
        return load_image(url, self.config)

    def processed(self, prompt: dict) -> dict:
        """A ``{"prompt": text, "multi_modal_data": {"image": ...}}`` prompt (vLLM's shape) as
        ``{"prompt", "prompt_token_ids", "mm_features"}``: what the engine runs, so that the
        processing may happen in the process in front of the engine's."""
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) != {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' only, got {sorted(data) if isinstance(data, dict) else data!r}")
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt', with one image "
                             f"placeholder ({self.image_token!r}) where each image goes")
        token_ids, features = self.process(prompt["prompt"], data["image"])
        rest = {key: value for key, value in prompt.items() if key not in ("multi_modal_data", "prompt_token_ids")}
        return {**rest, "prompt_token_ids": token_ids, "mm_features": features}

    def check_features(self, token_ids: list[int], features: Any) -> list[MultiModalFeature]:
        """Processed images given with token ids (``processed``'s output): each range inside
        the prompt, and every image token filled by exactly one image."""
        if not isinstance(features, (list, tuple)) or not all(isinstance(f, MultiModalFeature) for f in features):
            raise ValueError("mm_features must be a list of MultiModalFeature (from ImagePromptProcessor.processed)")
        self.check_count(len(features))
        covered = 0
        for feature in features:
            span = token_ids[feature.placeholder.offset:feature.placeholder.end]
            if feature.placeholder.offset < 0 or feature.placeholder.end > len(token_ids) \
                    or span.count(feature.embed_token_id) != feature.num_embeds:
                raise ValueError("mm_features do not match prompt_token_ids: an image's placeholder range does not "
                                 "hold its image tokens; process the prompt again")
            covered += feature.num_embeds
        if covered != token_ids.count(self.image_token_id):
            raise ValueError("prompt_token_ids hold image tokens no image fills; process the prompt again")
        return list(features)

    def check_count(self, count: int) -> None:
        limit = self.config.limit("image")
        if limit is not None and count > limit:
            raise ValueError(f"the prompt has {count} images, over limit_mm_per_prompt's {limit} "
                             "(--limit-mm-per-prompt); send fewer images")

    @classmethod
    def for_checkpoint(cls, path: str, image_token_id: int, config: MultiModalConfig | None = None,
                       attends_both_ways: bool = False, model_type: str | None = None) -> ImagePromptProcessor:
        from transformers import AutoProcessor

        if not any((Path(path) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
            raise ValueError(f"{path!r} is a vision-language checkpoint without processor_config.json: "
                             "its images cannot be processed as the model expects; add the processor's files")
        if model_type in GRID_PROCESSOR_TYPES:
            return cls(GridImageProcessor.from_pretrained(path), image_token_id, config, attends_both_ways)
        return cls(AutoProcessor.from_pretrained(path, local_files_only=True), image_token_id, config, attends_both_ways)

    def process(self, text: str, images: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids of ``text`` with each image token expanded, and the images' features.
        ``ValueError`` naming the problem: not PIL images, or as many image tokens in
        the text as images."""
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for index, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data['image'][{index}] is a {type(image).__name__}; pass PIL images")
            pixels = image.size[0] * image.size[1]
            if pixels > self.config.max_image_pixels:
                raise ValueError(f"image {index} has {pixels} pixels, over max_image_pixels "
                                 f"({self.config.max_image_pixels}); send a smaller image")
        self.check_count(len(images))
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
            # A processor that flattens the patches of its images (Qwen2-VL's: [patches, values]
            # beside ``image_grid_thw``) gives one image's pixel_values without a batch dimension.
            flat = "image_grid_thw" in alone
            if not flat and len(alone["pixel_values"]) != 1:  # e.g. Gemma 3's pan and scan: crops beside the image
                raise ValueError(f"the processor made {len(alone['pixel_values'])} entries of one image (pan and scan?), "
                                 "which is not supported; turn that option off in the processor's config")
            data = {name: value if flat and name == "pixel_values" else value[0]
                    for name, value in alone.items() if name in self.TENSORS}
            count = int((alone["input_ids"][0] == self.image_token_id).sum())
            mine = positions[used:used + count]
            if len(mine) != count:
                raise ValueError(f"the processor wrote {len(positions)} image tokens, fewer than the images need")
            used += count
            placeholder = PlaceholderRange(int(mine[0]), int(mine[-1]) + 1 - int(mine[0]))
            features.append(MultiModalFeature("image", image_content_hash(image), placeholder, self.image_token_id,
                                              count, data, self.attends_both_ways))
        if used != len(positions):
            raise ValueError(f"the prompt has {len(positions) - used} image tokens no image fills; "
                             "write images only through multi_modal_data and the image placeholder")
        return token_ids, features


def image_prompt_processor_for(model_config: Any, path: str,
                               config: MultiModalConfig | None = None) -> ImagePromptProcessor | None:
    """The processor of a vision-language checkpoint (its decoder config carries the whole
    config: ``model/vision/config.py``); None for a text-only model."""
    from pagedllm.model.registry import model_class_for

    whole = getattr(model_config, "vision_language_config", None)
    if whole is None:
        return None
    both_ways = getattr(model_class_for(model_config), "attends_images_both_ways", False)
    return ImagePromptProcessor.for_checkpoint(path, whole.image_token_id, config, both_ways,
                                              whole.model_type)

"""Images of Qwen2-VL-style checkpoints through their own image processor and tokenizer.

``Qwen2VLProcessor`` (and Qwen2.5-VL's) also holds a video processor, which needs torchvision
even for a prompt without video. Images need only the checkpoint's image processor
(``Qwen2VLImageProcessor``: dynamic resolution, each image resized to a multiple of the
patch and merge sizes within its pixel bounds, normalised, its patches flattened, and its
``image_grid_thw``) and its tokenizer, with the processor's own rule for each image token
(``replace_image_token``: as many as the image's merged patches, ``t * h * w / merge^2``).
``GridImageProcessor`` is that much of the processor, called as ``ImagePromptProcessor``
calls a Hugging Face processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The whole checkpoint's model_type of the families processed here.
GRID_PROCESSOR_TYPES = ("qwen2_vl", "qwen2_5_vl")


class GridImageProcessor:
    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token: str = getattr(tokenizer, "image_token", None) or "<|image_pad|>"  # the processor's default
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(cls, path: str) -> GridImageProcessor:
        """The folder's image processor, tokenizer and the processor's chat template (if saved)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(path)
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        elif (folder / "chat_template.json").is_file():
            template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        return cls(AutoImageProcessor.from_pretrained(path, local_files_only=True),
                   AutoTokenizer.from_pretrained(path, local_files_only=True), template)

    def __call__(self, text: list[str], images: list[list[Any]] | None = None, return_tensors: str = "pt") -> dict:
        """``input_ids`` of each text with its image tokens expanded (the images in order, across
        the texts), and the image processor's ``pixel_values`` and ``image_grid_thw`` of all images."""
        flat = [image for per_text in images or [] for image in per_text]
        outputs = dict(self.image_processor(images=flat, return_tensors="pt")) if flat else {}
        merge = self.image_processor.merge_size
        counts = iter((outputs["image_grid_thw"].prod(-1) // merge**2).tolist() if flat else [])
        expanded = []
        for one in text:
            head, *rest = one.split(self.image_token)
            expanded.append(head + "".join(self.image_token * next(counts) + part for part in rest))
        outputs["input_ids"] = self.tokenizer(expanded, return_tensors=return_tensors)["input_ids"]
        return outputs

"""The model and images of `pagedllm bench vision`: a random-weight Idefics3 checkpoint of
SmolVLM-256M-Instruct's shapes (or a tiny one for a quick check), written once into a work
folder with Hugging Face's own processor, and seeded drawings made with Pillow.

Nothing is downloaded: the tokenizer is SmolLM2's, read from the embedded GGUF (the engine's
default model), with SmolVLM's image and chat tokens added. The processor resizes every image
to one ``max_image_size`` tile (``size.longest_edge`` = the tile: SmolVLM's own default of
2048 would split each image into up to 16 tiles plus a global view, each tile a full pass of
the vision tower, too slow on a CPU for a 64-request run)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image, ImageDraw

# The processor's image tokens (Idefics3's) and SmolVLM's end of turn.
ADDED_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


@dataclass(frozen=True)
class VisionShape:
    """The sizes that set the cost: the SigLIP tower, the pixel-shuffle factor, the decoder."""

    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    image_size: int  # one tile's side in pixels
    patch_size: int
    scale_factor: int  # pixel shuffle: (image_size / patch_size / scale_factor)^2 image tokens per tile
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int


# SmolVLM-256M-Instruct's config.json: SigLIP base patch16-512, scale factor 4 (64 image
# tokens per tile), and SmolLM2-135M's decoder.
SHAPES = {
    "smolvlm-256m": VisionShape(768, 3072, 12, 12, 512, 16, 4, 576, 1536, 30, 9, 3),
    "tiny": VisionShape(32, 64, 2, 2, 32, 8, 2, 64, 128, 2, 4, 2),
}


def cached_vision_model(workdir: Path, shape_name: str, tokenizer=None) -> str:
    """The checkpoint folder of ``shape_name`` under ``workdir``, written on the first call
    (a folder whose recorded shape differs is written again). ``tokenizer``: SmolLM2's, when the
    caller has it loaded already (else read from the GGUF, a few seconds)."""
    shape = SHAPES[shape_name]
    folder = workdir / f"random-idefics3-{shape_name}"
    marker = folder / "bench_shape.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(shape):
        return str(folder)
    _write_model(folder, shape, tokenizer or _smollm2_tokenizer())
    marker.write_text(json.dumps(asdict(shape)))
    return str(folder)


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from pagedllm.model.loader import default_model_path

    gguf = Path(default_model_path())
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _write_model(folder: Path, shape: VisionShape, smollm2_tokenizer) -> None:
    import copy

    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor)

    tokenizer = copy.deepcopy(smollm2_tokenizer)  # the caller's stays without the added tokens
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    tile = {"longest_edge": shape.image_size}
    image_processor = Idefics3ImageProcessor(size=tile, max_image_size=tile)
    tokens_per_tile = (shape.image_size // shape.patch_size // shape.scale_factor) ** 2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=tokens_per_tile)
    text = dict(hidden_size=shape.text_hidden, intermediate_size=shape.text_intermediate,
                num_hidden_layers=shape.text_layers, num_attention_heads=shape.text_heads,
                num_key_value_heads=shape.text_kv_heads, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=100000.0, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                tie_word_embeddings=False)
    vision = dict(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                  num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                  image_size=shape.image_size, patch_size=shape.patch_size)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=shape.scale_factor,
                            tie_word_embeddings=False, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(58)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # well-separated logits: greedy ties are not decided by float noise
        model.lm_head.weight.normal_(0, 0.2)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def drawn_image(seed: int) -> Image.Image:
    """A seeded RGB drawing of 256-640 x 256-640 pixels: a two-colour gradient, a few
    shapes and a line of text (different seeds: different pixels, so different content hashes)."""
    rng = random.Random(seed)
    width, height = rng.randint(256, 640), rng.randint(256, 640)
    colour = lambda: tuple(rng.randrange(256) for _ in range(3))  # noqa: E731
    top, bottom = colour(), colour()
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for y in range(height):
        t = y / max(1, height - 1)
        draw.line([(0, y), (width, y)], fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom)))
    for _ in range(rng.randint(2, 5)):
        x0, y0 = rng.randrange(width - 20), rng.randrange(height - 20)
        box = (x0, y0, rng.randint(x0 + 10, width), rng.randint(y0 + 10, height))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour(), outline=colour())
    draw.text((rng.randrange(width // 2), rng.randrange(height - 12)), f"picture {seed}", fill=colour())
    return image

"""A tiny random Idefics3 checkpoint (tiny SigLIP + tiny Llama) with its processor, and drawn test images.

The processor is Hugging Face's own: SmolLM2's tokenizer with Idefics3's image
tokens added, and an ``Idefics3ImageProcessor`` with 32-pixel tiles, so an image
becomes up to 4 tiles plus its global view, 4 image tokens each (4x4 patches of
8 pixels, pixel-shuffled by 2)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]
# SmolVLM's chat template: it loops over each message's content parts and writes <image> for an image part.
CHAT_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
                 "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                 "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
                 "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def make_tiny_idefics3(folder: Path, tokenizer_folder: str) -> str:
    """Write the checkpoint and its processor to ``folder``; returns its path."""
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessor, Idefics3Processor)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHAT_TEMPLATE)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                initializer_range=0.2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=8, initializer_range=0.2)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, tie_word_embeddings=False,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(5678)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # well-separated logits: greedy ties are not decided by float noise
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0, 0.2)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def drawn_image(seed: int, size: tuple[int, int] = (48, 36)) -> Image.Image:
    """A small RGB drawing (background, ellipse, bar) that differs with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    colour = lambda: tuple(int(v) for v in torch.randint(0, 256, (3,), generator=generator))  # noqa: E731
    image = Image.new("RGB", size, colour())
    draw = ImageDraw.Draw(image)
    draw.ellipse((2, 2, size[0] // 2, size[1] // 2), fill=colour())
    draw.rectangle((size[0] // 3, size[1] - 10, size[0] - 2, size[1] - 2), fill=colour())
    return image

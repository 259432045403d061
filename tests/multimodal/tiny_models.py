"""Tiny random vision-language checkpoints (a tiny vision tower + the tiny Llama decoder
of the other tests) with their Hugging Face processors, made offline from SmolLM2's
tokenizer, and drawn test images.

- Idefics3: an ``Idefics3ImageProcessor`` with 32-pixel tiles, so an image becomes up to
  4 tiles plus its global view, 4 image tokens each (4x4 patches of 8 pixels,
  pixel-shuffled by 2).
- LLaVA: a ``CLIPImageProcessor`` that resizes and crops to 32x32, a 3-layer CLIP tower
  with 8-pixel patches: 16 image tokens an image (the class row dropped), read from the
  tower's second-to-last hidden state (llava-1.5's ``vision_feature_layer`` -2).
- LLaVA-NeXT: the same tower over "anyres" tiles (up to 2x2 of 32 pixels at the best of
  ``GRID_PINPOINTS``, plus the whole view), its grid rows cropped and ended by ``image_newline``.
- Gemma 3: a ``Gemma3ImageProcessor`` that resizes to 64x64, a SigLIP tower with 8-pixel
  patches (an 8x8 grid) pooled to 16 image tokens, and a two-layer Gemma 3 decoder (a
  sliding layer whose 8-token window is shorter than an image, and a full one); the
  tokenizer names its image tokens as Gemma's does (``boi_token``, ``eoi_token``, ``image_token``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

IDEFICS3_IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]
GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64]]
# SmolVLM's chat template: it loops over each message's content parts and writes <image> for an image part.
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
# Gemma's chat template, cut down: it loops over each message's content parts and writes
# <start_of_image> for an image part (the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
STD_GEMMA3 = 0.05  # larger and the tiny Gemma 3 repeats one token
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=32, patch_size=8, initializer_range=0.2)


def _tokenizer(tokenizer_folder: str, image_tokens: list[str]) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": image_tokens})
    return tokenizer


def _text_config(tokenizer: Any) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                initializer_range=0.2)


def _save(model_class: type, config: Any, processor: Any, folder: Path, std: float = 0.2) -> str:
    """A random ``model_class(config)`` and ``processor`` saved to ``folder``; returns its path."""
    torch.manual_seed(5678)
    model = model_class(config).eval()
    with torch.no_grad():  # well-separated logits: greedy ties are not decided by float noise
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0, std)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def make_tiny_idefics3(folder: Path, tokenizer_folder: str) -> str:
    """Write the checkpoint and its processor to ``folder``; returns its path."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    tokenizer = _tokenizer(tokenizer_folder, IDEFICS3_IMAGE_TOKENS)
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=IDEFICS3_CHAT_TEMPLATE)
    config = Idefics3Config(text_config=_text_config(tokenizer), vision_config=VISION, scale_factor=2,
                            tie_word_embeddings=False, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    return _save(Idefics3ForConditionalGeneration, config, processor, folder)


def make_tiny_llava(folder: Path, tokenizer_folder: str, family: str = "llava", tower: str = "clip",
                    **config: Any) -> str:
    """Write the checkpoint of ``family`` ("llava" or "llava_next"; ``config`` overrides its
    config's fields) and its processor to ``folder``; returns its path. ``tower`` "siglip" (with
    "llava"): a SigLIP tower (its pooling head saved, never read) behind a ``SiglipImageProcessor``."""
    import transformers

    names = {"llava": "Llava", "llava_next": "LlavaNext"}[family]
    tokenizer = _tokenizer(tokenizer_folder, ["<image>"])
    sizes = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    if family == "llava_next":  # a grid of up to 2x2 tiles of 32 pixels, and the whole view
        sizes["image_grid_pinpoints"] = config["image_grid_pinpoints"] = GRID_PINPOINTS
    image_processor = getattr(transformers, "CLIPImageProcessor" if family == "llava" else "LlavaNextImageProcessor")
    vision = dict(VISION, num_hidden_layers=3)
    if tower == "siglip":  # no class row: no additional image token
        image_processor, sizes = transformers.SiglipImageProcessor, dict(size={"height": 32, "width": 32})
        vision["model_type"] = "siglip_vision_model"
    processor = getattr(transformers, f"{names}Processor")(
        image_processor=image_processor(**sizes), tokenizer=tokenizer, patch_size=8,
        vision_feature_select_strategy=config.get("vision_feature_select_strategy", "default"),
        num_additional_image_tokens=int(tower == "clip"))
    whole = getattr(transformers, f"{names}Config")(
        text_config=_text_config(tokenizer), vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), **config)
    return _save(getattr(transformers, f"{names}ForConditionalGeneration"), whole, processor, folder)


def make_tiny_gemma3(folder: Path, tokenizer_folder: str) -> str:
    """Write the checkpoint and its processor to ``folder``; returns its path."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor
    from transformers import Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 64, "width": 64}),
                                tokenizer=tokenizer, image_seq_length=16, chat_template=GEMMA3_CHAT_TEMPLATE)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=2, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24, rms_norm_eps=1e-6,
                max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id)
    config = Gemma3Config(text_config=text, vision_config=dict(VISION, image_size=64, vision_use_head=False),
                          mm_tokens_per_image=16, boi_token_index=tokenizer.boi_token_id,
                          eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id)
    return _save(Gemma3ForConditionalGeneration, config, processor, folder, STD_GEMMA3)


def drawn_image(seed: int, size: tuple[int, int] = (48, 36)) -> Image.Image:
    """A small RGB drawing (background, ellipse, bar) that differs with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    colour = lambda: tuple(int(v) for v in torch.randint(0, 256, (3,), generator=generator))  # noqa: E731
    image = Image.new("RGB", size, colour())
    draw = ImageDraw.Draw(image)
    draw.ellipse((2, 2, size[0] // 2, size[1] // 2), fill=colour())
    draw.rectangle((size[0] // 3, size[1] - 10, size[0] - 2, size[1] - 2), fill=colour())
    return image


def images_of(spec: list) -> list[Image.Image]:
    """Drawn images from a test case's spec: a seed, or (seed, (width, height))."""
    return [drawn_image(*item) if isinstance(item, tuple) else drawn_image(item) for item in spec]


def hf_greedy(folder: str, model_class: str, cases: list[tuple[str, list]], max_tokens: int) -> list[list[int]]:
    """Hugging Face's free-running greedy tokens for each ``(text, image spec)`` case, by the
    checkpoint's own processor and ``transformers.<model_class>``."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    for text, spec in cases:
        images = images_of(spec)
        inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        outputs.append(generated[0, inputs["input_ids"].shape[1]:].tolist())
    return outputs



QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template, shortened: an image part is its vision markers around one <|image_pad|>.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_qwen2_vl(folder: Path, tokenizer_folder: str, family: str = "qwen2_vl") -> str:
    """Qwen2-VL (``family`` "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl"): a ``Qwen2VLImageProcessor``
    with 8-pixel patches merged 2x2 and 8..64 merged patches' worth of pixels (an image keeps its
    aspect ratio: dynamic resolution), a 2-block vision tower (Qwen2.5-VL's: windows of 2x2
    merged patches in block 0, full attention in block 1), and a Qwen2 decoder whose M-RoPE
    sections split its 8 frequencies 2/3/3. ``Qwen2VLProcessor`` itself needs torchvision (its
    video processor): the folder holds what it would save of it for images (the image
    processor, the tokenizer, the chat template)."""
    import transformers

    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[family]
    tokenizer = _tokenizer(tokenizer_folder, QWEN2_VL_TOKENS)
    image_processor = transformers.Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2,
                                                         min_pixels=8 * 16 * 16, max_pixels=64 * 16 * 16)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN2_VL_TOKENS)}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(_text_config(tokenizer), bos_token_id=None, rope_parameters=rope, **ids)
    vision = dict(depth=2, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                  initializer_range=0.2)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=48, window_size=32,
                      fullatt_block_indexes=[1])
    config = getattr(transformers, f"{names}Config")(text_config=text, vision_config=vision,
                                                     tie_word_embeddings=False, **ids)
    _save(getattr(transformers, f"{names}ForConditionalGeneration"), config, image_processor, folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    return str(folder)

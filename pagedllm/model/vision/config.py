"""A vision-language checkpoint's config as the engine reads it."""

from __future__ import annotations

import copy

from transformers import PretrainedConfig


def decoder_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The config every shape reader (pool sizing, rotary, sharding) sees: a
    vision-language checkpoint's ``text_config`` (a copy, so no config holds itself),
    carrying the whole config as ``vision_language_config`` and the top-level
    ``tie_word_embeddings`` (which Hugging Face ties by); any other config as it is."""
    if getattr(config, "vision_config", None) is None or getattr(config, "text_config", None) is None:
        return config
    decoder = copy.copy(config.text_config)
    decoder.vision_language_config = config
    # Qwen2-VL's text config has no such attribute: the decoder's value only where the whole has none.
    tied = getattr(config, "tie_word_embeddings", None)
    decoder.tie_word_embeddings = bool(getattr(decoder, "tie_word_embeddings", False) if tied is None else tied)
    return decoder

"""Multimodal rotary positions (M-RoPE, Qwen2-VL's) of a prompt, as plain data.

A text token's three positions (time, height, width) are one number, counting on from the
token before; an image's tokens take their place in the image's merged patch grid, each of
the three counting from where the text before the image stopped; the text after an image
continues from the largest position the image used, plus one (Hugging Face's
``get_rope_index``, images only). Tokens past the prompt (generated ones) take their index
plus the prompt's ``delta`` (largest position + 1 - prompt length) in all three.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_prompt_positions(num_tokens: int, images: Sequence[tuple[int, int, int, int]]) -> tuple[np.ndarray, int]:
    """([3, num_tokens] int64 positions, delta) of a prompt whose images are ``(offset, t, h, w)``:
    each image's placeholder run starts at ``offset`` and is its merged grid (``t * h * w``
    tokens, in t, h, w raster order), in prompt order. ``ValueError`` if the runs overlap or
    leave the prompt."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = current = 0
    for offset, frames, height, width in images:
        end = offset + frames * height * width
        if offset < cursor or end > num_tokens:
            raise ValueError(f"an image's {end - offset} tokens at {offset} overlap the image before or pass the "
                             f"prompt's {num_tokens} tokens; process the prompt again")
        positions[:, cursor:offset] = current + np.arange(offset - cursor)
        current += offset - cursor
        grid = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
        positions[:, offset:end] = np.stack(grid).reshape(3, -1) + current
        current += max(height, width)  # Hugging Face's step past an image (its frames are one for an image)
        cursor = end
    positions[:, cursor:] = current + np.arange(num_tokens - cursor)
    return positions, int(positions.max(initial=-1)) + 1 - num_tokens

"""Content hashes of images: equal exactly when the decoded pixels are equal."""

from __future__ import annotations

import hashlib

from PIL import Image


def image_content_hash(image: Image.Image) -> str:
    """sha256 (hex) of an image's mode, size and raw pixel bytes: the same picture
    from two files (or formats) hashes the same, any changed pixel differently, and
    a collision (one image's cached K/V served for another) has probability ~2^-128."""
    digest = hashlib.sha256(b"pagedllm-image-v1")
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()

"""The package logger. Like vLLM, pagedllm logs INFO lines (the start-up
capacity line among them) to stderr unless the application configured the
``pagedllm`` logger itself."""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("pagedllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)

"""What loading a checkpoint yields, whatever its format, and the checks every format shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from pagedllm.model.registry import SUPPORTED_ARCHITECTURES

WHAT_TO_PASS = "pass model=PATH to a .gguf file or a Hugging Face folder with config.json and *.safetensors"


@dataclass
class Checkpoint:
    config: PretrainedConfig  # a transformers config (LlamaConfig / Qwen2Config / Qwen3Config)
    state_dict: dict[str, torch.Tensor]  # Hugging Face parameter names -> tensors of the requested dtype
    tokenizer: PreTrainedTokenizerBase  # with chat_template set when the source has one
    path: str  # resolved path that was loaded


def check_architecture(architecture: Any) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )



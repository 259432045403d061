"""The Hugging Face transformers model for the same checkpoint: the correctness
oracle in tests and the baseline in benchmarks."""

from __future__ import annotations

import os

import torch


def load_hf_model(model: str | None = None, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM`` on the same local files pagedllm loads (GGUF
    files through transformers' own GGUF reader). Never reaches a hub."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import default_model_path

    path = model or default_model_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return hf_model.eval()

"""Which Hugging Face architectures (config ``model_type``) load, and the model class of each.

Every loader checks a checkpoint's architecture against ``SUPPORTED_ARCHITECTURES``
before it reads a tensor; ``model_class_for`` is the one place that maps an
architecture to the module that runs it.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma", "gemma2",
                           "gemma3_text")


def model_class_for(config: Any) -> type:
    """The model class for a transformers config; ValueError naming the supported architectures."""
    from pagedllm.model.gemma import GemmaForCausalLM
    from pagedllm.model.llama import LlamaForCausalLM

    classes = dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite"), LlamaForCausalLM)
    classes.update(dict.fromkeys(("gemma", "gemma2", "gemma3_text"), GemmaForCausalLM))
    model_type = getattr(config, "model_type", None)
    if model_type not in classes:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return classes[model_type]

"""A prompt with its token ids, for whoever tokenizes before the engine does.

The API side of an engine-core process and the offline fleet's router encode
text (and process images) here (the router hashes the blocks; the core then
receives token ids). Pure: the tokenizer and the image processor are passed in.
"""

from __future__ import annotations

from typing import Any


def tokenized(tokenizer: Any, prompt: Any, images: Any = None) -> Any:
    """``prompt`` with its token ids, so the core does not tokenize: text becomes
    ``{"prompt": text, "prompt_token_ids": ids}`` (the engine's own
    ``tokenizer.encode``); a prompt with ``multi_modal_data`` goes through ``images``
    (the model's ``ImagePromptProcessor``: token ids and ``mm_features``, so the core
    receives processed tensors); anything else goes as it is (the core validates it)."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        if images is None:
            raise ValueError("this model takes text only; drop multi_modal_data or load a vision-language "
                             "checkpoint (Idefics3 / SmolVLM)")
        return images.processed(prompt)
    if isinstance(prompt, str) and prompt:
        return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str) \
            and prompt["prompt"]:
        return {**prompt, "prompt_token_ids": tokenizer.encode(prompt["prompt"])}
    return prompt

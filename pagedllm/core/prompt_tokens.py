"""A prompt with its token ids, for whoever tokenizes before the engine does.

The API side of an engine-core process and the offline fleet's router encode
text here (the router hashes the blocks; the core then receives token ids).
Pure: the tokenizer is passed in.
"""

from __future__ import annotations

from typing import Any


def tokenized(tokenizer: Any, prompt: Any) -> Any:
    """``prompt`` with its token ids, so the core does not tokenize: text becomes
    ``{"prompt": text, "prompt_token_ids": ids}`` (the engine's own
    ``tokenizer.encode``); anything else goes as it is (the core validates it).
    Images are not carried to a core process yet: ``ValueError``, rather than their
    placeholders silently read as text."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        raise ValueError("multi_modal_data is not carried to an engine-core process yet (docs/vision.md); "
                         "run the engine in this process (engine_process=False, data_parallel_size=1)")
    if isinstance(prompt, str) and prompt:
        return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str) \
            and prompt["prompt"]:
        return {**prompt, "prompt_token_ids": tokenizer.encode(prompt["prompt"])}
    return prompt

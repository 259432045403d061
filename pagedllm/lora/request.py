"""``LoRARequest``: which adapter a request runs under (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request: ``lora_name`` names it (in the prefix-cache key, the
    served ``model`` field and the pool snapshot), ``lora_int_id`` (>= 1) is vLLM's
    numeric id, ``lora_path`` a PEFT folder or a llama.cpp GGUF LoRA file.

    Two requests with the same name run the same adapter: the engine keeps the
    first path it saw for a name, and refuses the same name with another path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name a PEFT folder or a GGUF LoRA file, got {self.lora_path!r}")

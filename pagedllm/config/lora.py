"""The engine's LoRA options (vLLM's names), flattened into ``LLM(...)`` and the command line."""

from __future__ import annotations

from dataclasses import dataclass, field

# The largest rank the C++ product kernel takes (``kernels/csrc/lora_ops.cpp``).
MAX_SUPPORTED_RANK = 64


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(
        default=False,
        metadata={"help": "serve LoRA adapters on the base model: requests name one (lora_request, or the "
                          "served model name); their weights are paged into the KV pool's blocks"},
    )
    max_loras: int | None = field(
        default=None,
        metadata={"help": "most distinct adapters in one step (None: as many as the pool's pages hold); "
                          "idle adapters stay resident, evicted least recently used beside cached prefix blocks"},
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": f"largest adapter rank accepted (at most {MAX_SUPPORTED_RANK})"},
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if name == "max_loras" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank > MAX_SUPPORTED_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_SUPPORTED_RANK}, got {self.max_lora_rank}")

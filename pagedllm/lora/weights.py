"""One adapter's weights as read from its file, before they are paged into the pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The projections an adapter may target, by their Hugging Face names (every Llama-family
# model here has all seven).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAWeights:
    """A LoRA adapter: for each (layer index, module name in ``LORA_MODULES``) it targets,
    ``A`` of ``[rank, in_features]`` and ``B`` of ``[out_features, rank]`` (PEFT's
    ``lora_A.weight`` / ``lora_B.weight``), so the module's output gains
    ``scaling * x @ A.T @ B.T``. ``scaling`` is ``lora_alpha / rank`` (``lora_alpha /
    sqrt(rank)`` with rslora). Tensors are fp32 on CPU as read; the pager converts."""

    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The modules any layer targets, in ``LORA_MODULES`` order."""
        present = {module for _, module in self.tensors}
        return tuple(m for m in LORA_MODULES if m in present)

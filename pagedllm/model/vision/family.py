"""What every vision-language family class shares: the Llama-family decoder over the
checkpoint's ``text_config`` (``LlamaForCausalLM``: the loader hands that config over,
carrying the whole one as ``vision_language_config``, ``model/vision/config.py``), one
rank, and loading Hugging Face's names through a family's prefix renames. A family adds
its tower and connector modules and ``embed_image`` (one image's decoder-width rows, in
placeholder order), which the runner puts at the image's placeholder tokens
(``LlamaForCausalLM.forward``'s ``multimodal_embeds``)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.llama import LlamaForCausalLM


class VisionLanguageCausalLM(LlamaForCausalLM):
    """A family subclasses it with its ``vision_language_types`` (the whole checkpoint's
    ``model_type``, which the registry maps) and ``renames`` (Hugging Face prefix -> this
    module's, the first that matches)."""

    vision_language_types: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        if tp.world_size > 1:
            raise ValueError("vision-language models run on one rank for now; set tensor_parallel_size=1")
        super().__init__(config, max_position, tp)

    @staticmethod
    def tower_config(config: PretrainedConfig, towers: tuple[str, ...], family: str) -> PretrainedConfig:
        """The whole checkpoint's ``vision_config``; ValueError unless its ``model_type`` is one of ``towers``."""
        vision = config.vision_language_config.vision_config
        if vision.model_type not in towers:
            raise ValueError(f"{family} with a {vision.model_type!r} vision tower is not supported; "
                             f"supported towers: {', '.join(towers)}")
        return vision

    def unused_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor (by this module's name) is one the family never reads."""
        return False

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Hugging Face's names, renamed to this module's, less the unused tensors, then
        ``LlamaForCausalLM``'s loading (which also fuses the tower's q/k/v)."""
        for name in list(state_dict):
            tensor = state_dict.pop(name)
            for source, target in self.renames:
                if name.startswith(source):
                    name = target + name[len(source):]
                    break
            if not self.unused_weight(name):
                state_dict[name] = tensor
        super().load_weights(state_dict)

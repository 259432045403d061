"""LLaVA (``LlavaForConditionalGeneration``, llava-1.5's layout): a CLIP or SigLIP vision
tower read at ``vision_feature_layer``, a two-layer MLP projector into the decoder's width,
and a Llama-family decoder
(``model/vision/family.py``). The processor writes one image token per row the model
gives (``LlavaProcessor``: a row per patch, plus the class row under the "full"
strategy), so ``embed_image``'s rows replace those tokens one for one, as Hugging
Face's ``masked_scatter`` does."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.vision.clip import CLIPVisionTransformer
from pagedllm.model.vision.encoder import activation
from pagedllm.model.vision.family import VisionLanguageCausalLM
from pagedllm.model.vision.siglip import SiglipHiddenStates

_STRATEGIES = ("default", "full")  # "default" drops the class row, "full" keeps it
# vision_config.model_type -> the tower (both read hidden states up to the last layer read).
_TOWERS = {"clip_vision_model": CLIPVisionTransformer, "siglip_vision_model": SiglipHiddenStates}


class LlavaMultiModalProjector(nn.Module):
    """Vision width (times the number of layers read) -> decoder width, an activation, -> decoder width."""

    def __init__(self, config: PretrainedConfig, num_feature_layers: int) -> None:
        super().__init__()
        width, bias = config.text_config.hidden_size, config.multimodal_projector_bias
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, width, bias=bias)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(width, width, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


def feature_layers_of(config: PretrainedConfig) -> list[int]:
    """``vision_feature_layer`` (one index or a list, negative from the end) as Hugging Face
    ``hidden_states`` indices from 0 (the encoder's input) to ``num_hidden_layers``."""
    layers = config.vision_feature_layer
    count = config.vision_config.num_hidden_layers + 1
    indices = [layers] if isinstance(layers, int) else list(layers)
    for index in indices:
        if not -count <= index < count:
            raise ValueError(f"vision_feature_layer {index} is outside the tower's {count} hidden states")
    return [index % count for index in indices]


class LlavaForConditionalGeneration(VisionLanguageCausalLM):
    """The decoder (``model``, ``lm_head``) plus ``vision_tower`` (only the layers up to the
    last one read) and ``multi_modal_projector``. SigLIP has no class row: "default" drops the
    first patch's row all the same, as Hugging Face does (SigLIP LLaVAs run "full")."""

    vision_language_types = ("llava",)
    # Hugging Face 5's names, then the hub's (transformers 4) llava-1.5 layout.
    renames = (("model.language_model.", "model."), ("model.vision_tower.vision_model.", "vision_tower."),
               ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
               ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.vision_model.", "vision_tower."))

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, max_position, tp)
        whole = config.vision_language_config
        vision = self.tower_config(config, tuple(_TOWERS), "LLaVA")
        if whole.vision_feature_select_strategy not in _STRATEGIES:
            raise ValueError(f"unsupported vision_feature_select_strategy {whole.vision_feature_select_strategy!r}; "
                             f"supported: {', '.join(_STRATEGIES)}")
        self.feature_layers = feature_layers_of(whole)
        self.drop_class_row = whole.vision_feature_select_strategy == "default"
        self.vision_tower = _TOWERS[vision.model_type](vision, max(self.feature_layers))
        self.multi_modal_projector = LlavaMultiModalProjector(whole, len(self.feature_layers))

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] -> [tiles, rows, decoder width]: the selected hidden states of each
        tile (concatenated), its class row dropped under "default", through the projector."""
        weight = self.multi_modal_projector.linear_1.weight
        pixels = pixel_values.to(weight.device, weight.dtype)
        features = torch.cat(self.vision_tower(pixels.reshape(-1, *pixels.shape[-3:]), self.feature_layers), dim=-1)
        if self.drop_class_row:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's decoder-width rows: a row per patch in raster order (after the class row under "full")."""
        features = self.tile_features(data["pixel_values"])
        return features.reshape(-1, features.shape[-1])

    def unused_weight(self, name: str) -> bool:
        """The tower's layers after the last one read, its pooled head (CLIP's norm, SigLIP's
        final norm and attention-pooling head), and an old checkpoint's ``position_ids`` buffer:
        dropped on loading, never held."""
        parts = name.split(".")
        return (parts[:2] in (["vision_tower", "post_layernorm"], ["vision_tower", "head"])
                or name == "vision_tower.embeddings.position_ids"
                or (parts[:3] == ["vision_tower", "encoder", "layers"]
                    and int(parts[3]) >= len(self.vision_tower.encoder.layers)))

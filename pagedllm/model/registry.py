"""Which Hugging Face architectures (config ``model_type``) load, the model class of each, and building one.

Every loader checks a checkpoint's architecture against ``SUPPORTED_ARCHITECTURES``
before it reads a tensor; ``model_class_for`` is the one place that maps an
architecture to the class that runs it, and ``build_model`` the one place that
turns a loaded checkpoint into a ``CausalLM``. The model modules never import
this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.base import CausalLM
from pagedllm.model.cohere2 import Cohere2ForCausalLM
from pagedllm.model.gemma import GemmaForCausalLM
from pagedllm.model.gemma3_vision import Gemma3ForConditionalGeneration
from pagedllm.model.gpt_oss import fp32_norm_weights
from pagedllm.model.idefics3 import Idefics3ForConditionalGeneration
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.llama4 import Llama4ForCausalLM
from pagedllm.model.llava import LlavaForConditionalGeneration
from pagedllm.model.llava_next import LlavaNextForConditionalGeneration
from pagedllm.model.moe_families import MoeForCausalLM
from pagedllm.model.packed_linear import pack_linears
from pagedllm.model.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

if TYPE_CHECKING:
    from pagedllm.model.checkpoint import Checkpoint

_VISION_LANGUAGE = (Idefics3ForConditionalGeneration, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration,
                    Gemma3ForConditionalGeneration,
                    Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)
# model_type -> the class that runs it (each family lists its own types).
_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **dict.fromkeys(LlamaForCausalLM.model_types, LlamaForCausalLM),
    **dict.fromkeys(GemmaForCausalLM.model_types, GemmaForCausalLM),
    **dict.fromkeys(Cohere2ForCausalLM.model_types, Cohere2ForCausalLM),
    **dict.fromkeys(Llama4ForCausalLM.model_types, Llama4ForCausalLM),
    **dict.fromkeys(MoeForCausalLM.model_types, MoeForCausalLM),
    # Vision-language families, by the whole checkpoint's model_type (their decoder's config has its own).
    **{kind: family for family in _VISION_LANGUAGE for kind in family.vision_language_types},
}
SUPPORTED_ARCHITECTURES = tuple(_CLASSES)
# The vision-language ones: their decoder is one of the others (``text_config``).
VISION_LANGUAGE_ARCHITECTURES = tuple(kind for family in _VISION_LANGUAGE for kind in family.vision_language_types)


def model_class_for(config: Any) -> type[LlamaForCausalLM]:
    """The model class for a transformers config; ValueError naming the supported architectures
    (for a vision-language checkpoint, also its decoder's: ``text_config``)."""
    model_type = getattr(getattr(config, "vision_language_config", config), "model_type", None)
    if model_type not in _CLASSES:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = _CLASSES[model_type]
    if hasattr(config, "vision_language_config") and config.model_type not in family.model_types:
        raise ValueError(f"a {model_type} checkpoint with a {config.model_type!r} decoder is not supported; "
                         f"its text_config may be one of: {', '.join(family.model_types)}")
    return family


def build_model(checkpoint: Checkpoint, max_model_len: int, device: torch.device, dtype: torch.dtype,
                tp: TensorParallelGroup = SINGLE) -> CausalLM:
    """This rank's shard of a loaded checkpoint (the whole model with one rank), ready to run.

    The model is built on the meta device and its parameters are the
    checkpoint's tensors (see ``CausalLM.load_weights``): peak memory is the
    weights once, plus one layer's fused projections. Consumes
    ``checkpoint.state_dict``. An fp32 or bf16 model on a CPU with AVX-512 and
    no AMX has its linear layers packed for the C++ packed kernel (``packed_linear``).
    """
    with torch.device("meta"):
        model = model_class_for(checkpoint.config)(checkpoint.config, max_position=max_model_len, tp=tp)
    model.load_weights(checkpoint.state_dict)
    # gpt-oss's norm weights stay fp32 in an fp16 model, as Hugging Face keeps them.
    keep_fp32 = fp32_norm_weights(checkpoint.config, dtype)
    kept = {name: param.detach() for name, param in model.named_parameters() if keep_fp32(name)}
    model = model.to(device=device, dtype=dtype).eval()  # (converts each parameter's data in place)
    for name, tensor in kept.items():
        model.get_parameter(name).data = tensor.to(device)
    pack_linears(model)
    return model

"""Swap a model's linear layers and embedding for packed ones, from the packed
weights of a loaded GGUF state dict.

`install_packed_weights(model, state_dict, fused)` takes every `PackedWeight`
out of the state dict, replaces the module that would have held it, and
returns the rest (dense tensors only) for the usual `load_state_dict`.

Safety rules:
- Fused projections (`fused`: fused module name -> Hugging Face part names)
  become one `QuantizedLinear` when all their parts are packed; if only some
  are, the packed ones are dequantized and the usual fusing concatenates them.
- A tied LM head multiplies by the packed embedding's own blocks.
- With tensor parallelism (> 1 rank) every packed weight is dequantized to the
  model dtype, tensor by tensor, with a log line: shards are cut from dense weights.
- A packed weight with no linear or embedding module to hold it is
  dequantized (and then loads, or fails, like any dense tensor).
"""

from __future__ import annotations

from torch import nn

from pagedllm.logger import init_logger
from pagedllm.model.layers import replace_submodule
from pagedllm.model.quantized.modules import PackedEmbedding, QuantizedLinear
from pagedllm.model.quantized.packed import PackedWeight

logger = init_logger(__name__)


def install_packed_weights(model: nn.Module, state_dict: dict, fused: dict[str, tuple[str, ...]]) -> dict:
    """Install `state_dict`'s packed weights into `model`; returns the dense remainder."""
    packed = {name: value for name, value in state_dict.items() if isinstance(value, PackedWeight)}
    if not packed:
        return state_dict
    dense = {name: value for name, value in state_dict.items() if name not in packed}
    tp = getattr(model, "tp", None)
    if tp is not None and tp.world_size > 1:
        logger.info("tensor parallelism: the packed GGUF weights are dequantized to %s for sharding",
                    next(iter(packed.values())).dtype)
        return {**dense, **{name: weight.dequantize() for name, weight in packed.items()}}
    _install_fused(model, packed, fused)
    for name in list(packed):
        module_name = name.removesuffix(".weight")
        module = _find(model, module_name)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _check_shape(name, packed[name].shape, tuple(module.weight.shape))
        if isinstance(module, nn.Linear):
            replace_submodule(model, module_name, QuantizedLinear([packed.pop(name)], module.bias is not None,
                                                                  module.weight.device))
        elif isinstance(module, nn.Embedding):
            replace_submodule(model, module_name, PackedEmbedding(packed.pop(name)))
    embedding = _find(model, "model.embed_tokens")
    if getattr(model, "tie_word_embeddings", False) and isinstance(embedding, PackedEmbedding):
        # compute_logits uses lm_head whenever the model has one; this one shares the blocks.
        model.lm_head = embedding.as_linear()
    # Whatever found no packed module loads dense (or fails as an unexpected tensor would).
    return {**dense, **{name: weight.dequantize() for name, weight in packed.items()}}


def _install_fused(model: nn.Module, packed: dict[str, PackedWeight], fused: dict[str, tuple[str, ...]]) -> None:
    """Replace each fused projection whose parts are all packed (partly packed ones stay in
    `packed`, which the caller dequantizes)."""
    for name, module in list(model.named_modules()):
        for target, parts in fused.items():
            if not name.endswith("." + target):
                continue
            prefix = name.removesuffix(target)
            names = [f"{prefix}{part}.weight" for part in parts]
            if all(part in packed for part in names):
                weights = [packed.pop(part) for part in names]
                rows = sum(weight.shape[0] for weight in weights)
                for part, weight in zip(names, weights):
                    _check_shape(part, (rows, weight.shape[1]), tuple(module.weight.shape))
                replace_submodule(model, name, QuantizedLinear.fused(weights, module.bias is not None, module.weight.device))


def _check_shape(name: str, shape: tuple[int, int], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise ValueError(f"checkpoint does not match the model: {name} is {list(shape)}, the model expects "
                         f"{list(expected)}")


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None

"""A plain Llama stack's decode step for a few sequences in one C++ call.

At batch 1 on SmolLM2-135M (30 layers) the per-operation overhead of the decoder
(a Python module call, tensor views and a pybind crossing per op, about ten ops a
layer) cost ~4.3 ms of CPU a token, over a quarter of a Q4_1 token on one thread
(docs/architecture.md, "Fused decode step"). ``DecodeStack`` (kernels/csrc/decode_stack.cpp) holds each
layer's weights and KV pool and runs all the layers, then the final norm, calling
the same C++ functions the per-op path reaches through Python, on the same tensors
in the same order: results are bit for bit the per-op path's.

Whether a model can use it is decided once, when its first eligible step builds
the stack (``build_stack``): every layer the plain Llama layer on one rank (no
LoRA projections, q/k norms, sliding windows, soft caps, sinks, length-dependent
or interleaved ropes, Granite multipliers), weights of the three kernel kinds, one
dtype, a pool in that dtype without tails, and the C++ decode kernel as the
backend's. Whether a step uses it is decided per step from plain data
(``runs_step``): a pure decode step of at most ``MAX_FUSED_ROWS`` sequences with
one KV group. Anything else takes the per-op path, unchanged.
``PAGEDLLM_FUSED_DECODE=0`` turns it off (the A/B switch of ``bench latency``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.selector import cpu_decode
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.layers import GatedMLP, Linear, RMSNorm, silu_and_mul
from pagedllm.model.packed_linear import PackedLinear
from pagedllm.model.quantized.modules import QuantizedLinear

# Sequences a fused step takes at most: the brief's "small batches", where overhead dominates;
# beyond it the kernels' work does and the per-op path is as fast. The dense kernel
# (``linear_small_batch``) takes up to 8 rows everywhere (``layers.small_batch_rows``).
MAX_FUSED_ROWS = 8

SWITCH = "PAGEDLLM_FUSED_DECODE"

_DENSE, _PACKED, _QUANTIZED = 0, 1, 2


def fused_decode_enabled() -> bool:
    """``PAGEDLLM_FUSED_DECODE``: "0" runs every step op by op; anything else fuses where it can."""
    return os.environ.get(SWITCH, "1") != "0"


def runs_step(metadata: AttentionMetadata, num_tokens: int) -> bool:
    """Whether this step is one a stack runs: decode rows only, few of them, one KV group,
    no tails. A speculative verify step's tokens are decode rows too (each with its own
    table row and context length, written before any is read, as the per-op path does),
    so one stream's n-gram or draft verify step of <= MAX_FUSED_ROWS tokens is fused."""
    return not metadata.prefills and metadata.num_decodes == num_tokens <= MAX_FUSED_ROWS \
        and metadata.group_views is None and metadata.tail_write_rows is None


def _linear_spec(kernels: Any, module: nn.Module, dtype: torch.dtype):
    """``module`` as a ``FusedLinear`` (None: not a kind the stack runs)."""
    if type(module) is Linear:
        if module.weight.dtype != dtype or not module.weight.is_contiguous():
            return None
        return kernels.fused_linear(_DENSE, [module.weight], [], [], [], module.out_features, module.bias, False)
    if type(module) is PackedLinear:
        return kernels.fused_linear(_PACKED, [module.packed_weight], [], [], [], module.out_features, module.bias,
                                    False)
    if type(module) is QuantizedLinear:
        blocks = [getattr(module, f"blocks_{index}") for index in range(len(module.qtypes))]
        starts, stops = zip(*module.bounds)
        return kernels.fused_linear(_QUANTIZED, blocks, [int(qtype) for qtype in module.qtypes], list(starts),
                                    list(stops), module.out_features, module.bias, module.packed_tiles)
    return None


def _plain_layer(layer: nn.Module, eps: float) -> bool:
    """Whether a decoder layer is exactly the plain Llama layer the C++ stack runs (a mixture of
    experts' layer is a ``DecoderLayer`` with another ``mlp``: not one)."""
    from pagedllm.model.llama import Attention, DecoderLayer  # llama imports this module

    attn = getattr(layer, "self_attn", None)
    if type(layer) is not DecoderLayer or type(attn) is not Attention or layer.residual_multiplier is not None:
        return False
    rotary = attn.rotary
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return attn.tp.world_size == 1 and attn.q_norm is None and attn.sliding_window is None \
        and attn.logits_soft_cap is None and attn.attention_chunk is None and attn.sinks is None \
        and rotary is not None and rotary.threshold is None and not rotary.interleaved \
        and type(layer.mlp) is GatedMLP and layer.mlp.act_and_mul is silu_and_mul and layer.mlp.tp.world_size == 1 \
        and all(type(norm) is RMSNorm and norm.eps == eps for norm in norms)


def _plain_cache(cache: LayerKVCache, dtype: torch.dtype) -> bool:
    return not cache.quantized and not cache.has_tails and cache.group == 0 and cache.key.dtype == dtype


def build_stack(model: nn.Module, kv_caches: list[LayerKVCache], backend: Any):
    """The ``DecodeStack`` of ``model`` (a ``LlamaForCausalLM``) over ``kv_caches``, or None
    where any part of it is not what the stack runs (see the module doc)."""
    kernels = load_cpu_kernels()
    decoder = model.model
    norm, layers = decoder.norm, list(decoder.layers)
    if kernels is None or getattr(backend, "decode_kernel", None) is not cpu_decode or not layers \
            or type(norm) is not RMSNorm or len(kv_caches) != len(layers):
        return None
    dtype, eps = norm.weight.dtype, norm.eps
    if dtype not in (torch.float32, torch.bfloat16) or not norm.weight.is_cpu:
        return None
    if not all(_plain_layer(layer, eps) and _plain_cache(cache, dtype) for layer, cache in zip(layers, kv_caches)):
        return None
    attn = layers[0].self_attn
    rotary = attn.rotary
    if any(layer.self_attn.rotary is not rotary or layer.self_attn.scale != attn.scale for layer in layers):
        return None
    stack = kernels.DecodeStack(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, eps,
                                rotary.cos_cache, rotary.sin_cache, norm.weight)
    for layer, cache in zip(layers, kv_caches):
        linears = [_linear_spec(kernels, module, dtype) for module in
                   (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(spec is None for spec in linears):
            return None
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *linears,
                        cache.key, cache.value)
    return stack


class FusedDecode:
    """A model's stack, built at its first eligible step for the pool it ran over
    (rebuilt if the model is run over another pool)."""

    def __init__(self) -> None:
        self._caches: list[LayerKVCache] | None = None
        self._stack = None

    @property
    def checked(self) -> bool:
        """Whether an eligible step has asked for the stack (and it was built or refused)."""
        return self._caches is not None

    @property
    def active(self) -> bool:
        """Whether eligible steps run through the stack."""
        return self._stack is not None

    def forward(self, model: nn.Module, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], metadata: AttentionMetadata, backend: Any) -> torch.Tensor | None:
        """The final hidden states of a step the stack runs, from the embeddings
        ``hidden`` (used in place as the first residual); None where the per-op path must."""
        if not runs_step(metadata, hidden.shape[0]) or not fused_decode_enabled():
            return None
        if kv_caches is not self._caches:
            self._caches, self._stack = kv_caches, build_stack(model, kv_caches, backend)
        if self._stack is None:
            return None
        return self._stack.forward(hidden, positions, metadata.slot_mapping, metadata.decode_block_tables,
                                   metadata.decode_context_lens)

"""Llama-family decoder (Llama, SmolLM 2/3, Mistral, Qwen2, Qwen3, Phi-3, Granite) over a paged KV pool.

Tokens of all sequences in a step are flattened into one [num_tokens, hidden]
batch; the attention backend uses the step's metadata to find each token's
sequence, context and KV slots. Parameter names match Hugging Face, so a
Hugging Face state dict loads as is.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.distributed.group import SINGLE, TensorParallelGroup
from pagedllm.model.sharding import shard_layout, shard_state_dict
from pagedllm.model.shapes import classifier_labels_of, head_dim_of, num_kv_heads_of, sliding_windows_of
from pagedllm.model.fused_decode import FusedDecode
from pagedllm.model.layers import Embedding, GatedMLP, Linear, RMSNorm, linear
from pagedllm.model.quantized import install_packed_weights
from pagedllm.model.rotary import RotaryEmbedding, context_window_of

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite")
# Qwen2's decoder, and the same decoder as Qwen2-VL's and Qwen2.5-VL's ``text_config`` names it.
QWEN2_DECODER_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor
    parallelism): q/k/v are column-parallel, o_proj row-parallel and summed."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding | None, tp: TensorParallelGroup,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.tp = tp
        # This layer's window (None: full attention), score cap (Gemma 2), attention
        # chunk (Llama 4's chunked local layers) and sinks (gpt-oss's per-head
        # parameter), as Hugging Face applies them.
        self.sliding_window = sliding_window
        self.logits_soft_cap: float | None = None
        self.attention_chunk: int | None = None
        self.sinks: torch.Tensor | None = None
        layout = shard_layout(config, tp)
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.head_dim = head_dim_of(config)
        # Granite's attention_multiplier replaces the usual 1/sqrt(head_dim).
        self.scale = getattr(config, "attention_multiplier", None) or self.head_dim**-0.5
        hidden = config.hidden_size
        # Qwen2 always has q/k/v biases, Qwen2-MoE per `qkv_bias`; Llama and Qwen3 follow `attention_bias`.
        qkv_bias = config.model_type in QWEN2_DECODER_TYPES or bool(getattr(config, "qkv_bias", False)) \
            or bool(getattr(config, "attention_bias", False))
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type not in QWEN2_DECODER_TYPES
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        if config.model_type in ("qwen3", "qwen3_moe"):
            # Qwen3 normalises each head's q and k before the rotation.
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.position(positions, q, k, metadata)
        # A hybrid KV layout: this layer reads its own group's block tables.
        out = backend.forward(q, k, v, kv_cache, metadata.for_cache(kv_cache), self.scale,
                              sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                              attention_chunk=self.attention_chunk, sinks=self.sinks)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)))

    def position(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as attention reads them: normalised (Qwen3, Gemma 3), then rotated."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # None: a SmolLM3 "NoPE" layer, which attends without positions
            q, k = self.rotary(positions, q, k, metadata)
        return q, k


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding | None, tp: TensorParallelGroup,
                 sliding_window: int | None = None, attention: Attention | None = None) -> None:
        """``attention``: a family's own attention module (Llama 4's), else Llama's."""
        super().__init__()
        self.self_attn = attention or Attention(config, rotary, tp, sliding_window)
        self.mlp = GatedMLP(config.hidden_size, shard_layout(config, tp).intermediate_size,
                            bool(getattr(config, "mlp_bias", False)), tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = getattr(config, "residual_multiplier", None)  # Granite's

    def forward(
        self, positions, hidden, residual: torch.Tensor | None, kv_cache, metadata, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it).

        The residual add is deferred into the next norm (add-then-norm in one
        pass), so the stream is only summed where it is normalised: the same
        additions, in the same dtype and order, as Hugging Face's layer."""
        if residual is None:
            residual = hidden  # the embedding output: a fresh tensor, safe to add into
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = _times(self.self_attn(positions, hidden, kv_cache, metadata, backend), self.residual_multiplier)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return _times(self.mlp(hidden), self.residual_multiplier), residual


def check_silu(config: PretrainedConfig) -> None:
    """ValueError unless the MLP's activation is SiLU (the fused gated MLP's)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")


def _times(x: torch.Tensor, multiplier: float | None) -> torch.Tensor:
    """x * multiplier (Granite's scalings, in the model dtype as Hugging Face's); x without one."""
    return x if multiplier is None else x * multiplier


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        # One rotary table shared by all layers (it holds no weights).
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary if uses_rope else None, tp, window)
                                    for uses_rope, window in zip(rope_layers_of(config), sliding_windows_of(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def rope_layers_of(config: PretrainedConfig) -> list[bool]:
    """Whether each layer rotates q and k: all of them, but SmolLM3's ``no_rope_layers`` (1: rope, 0: none)."""
    flags = getattr(config, "no_rope_layers", None)
    return [bool(flag) for flag in flags] if flags is not None else [True] * config.num_hidden_layers


# Hugging Face projections that run as one fused matmul here: fused name -> parts, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate each layer's q/k/v and gate/up weights (and biases) along the output dim,
    in place: the parts leave the dict as their fused tensor enters it, so a layer's
    parts and its fused copy are never both held beyond that layer. Returns the dict."""
    prefixes = {name.rsplit(".self_attn.", 1)[0] for name in state_dict if ".self_attn." in name}
    for prefix in sorted(prefixes):
        for target, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                names = [f"{prefix}.{part}.{suffix}" for part in parts]
                if all(name in state_dict for name in names):
                    state_dict[f"{prefix}.{target}.{suffix}"] = torch.cat([state_dict.pop(name) for name in names])
    return state_dict


def split_fused_projections(state_dict: dict[str, torch.Tensor], config: PretrainedConfig) -> None:
    """Split checkpoint-fused q|k|v and gate|up weights (Phi-3's) into Hugging Face's separate
    parts, in place and as views, so tensor parallelism can slice each part."""
    head_dim = head_dim_of(config)
    sizes = {"self_attn.qkv_proj": [config.num_attention_heads * head_dim] + [num_kv_heads_of(config) * head_dim] * 2,
             "mlp.gate_up_proj": [config.intermediate_size] * 2}
    for name in list(state_dict):
        for target, size in sizes.items():
            if f".{target}." in name:
                prefix, suffix = name.split(f".{target}.")
                for part, tensor in zip(_FUSED[target], state_dict.pop(name).split(size)):
                    state_dict[f"{prefix}.{part}.{suffix}"] = tensor


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head (a ``model.base.CausalLM``). ``forward`` returns final hidden states; call
    ``compute_logits`` only on the rows that need them (sampling positions).
    A family with another decoder subclasses it and overrides ``model_types``
    and ``build_decoder``; loading and the LM head are shared."""

    model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES

    def __init__(self, config: PretrainedConfig, max_position: int | None = None,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        if config.model_type not in self.model_types:
            raise ValueError(
                f"unsupported architecture {config.model_type!r}; supported: {', '.join(self.model_types)}"
            )
        self.config = config
        self.tp = tp
        # KV heads this rank stores (all of them with one rank): its pool's width.
        self.num_kv_heads = shard_layout(config, tp).num_kv_heads
        self.model = self.build_decoder(config, max_position or context_window_of(config), tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A sequence classifier's ``score`` head takes the LM head's place (compute_logits gives its labels).
        num_labels = classifier_labels_of(config)
        if num_labels is not None:
            self.score = Linear(config.hidden_size, num_labels, bias=False)
            self.tie_word_embeddings = False
        elif not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Granite scales the embeddings and divides the logits; other models have neither.
        self.embedding_multiplier = getattr(config, "embedding_multiplier", None)
        self.logits_scaling = getattr(config, "logits_scaling", None)
        self.fused_decode = FusedDecode()

    @property
    def rope_depends_on_length(self) -> bool:
        """Whether some layer's rotary frequencies change with the sequence length (``CausalLM``)."""
        return any(isinstance(m, RotaryEmbedding) and m.threshold is not None for m in self.modules())

    @staticmethod
    def build_decoder(config: PretrainedConfig, max_position: int, tp: TensorParallelGroup) -> nn.Module:
        """The embedding, layers and final norm (``self.model``)."""
        check_silu(config)
        return DecoderModel(config, max_position, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        multimodal_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the step's tokens. ``multimodal_embeds`` (rows, embeddings):
        an image's encoder rows replace its placeholder tokens' embeddings (``model/vision/family.py``)."""
        hidden = self.model.embed_tokens(input_ids)
        if multimodal_embeds is not None:
            rows, embeds = multimodal_embeds
            hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        # After the image rows: Hugging Face's Granite scales whatever embeddings its decoder is given.
        hidden = _times(hidden, self.embedding_multiplier)
        if multimodal_embeds is None and positions.dim() == 1:  # (M-RoPE's [3, tokens] runs per op)
            # A few sequences' decode step in one C++ call where the stack allows (``fused_decode``).
            fused = self.fused_decode.forward(self, hidden, positions, kv_caches, metadata, backend)
            if fused is not None:
                return fused
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, backend)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler reads bf16 ones as fp32
        without a copy when it only needs the argmax. A sequence classifier's
        are its labels' (the ``score`` head)."""
        if hasattr(self, "score"):
            return self.score(hidden)
        # A tied head has no module of its own unless its weight is packed (GGUF blocks
        # or the packed kernel's layout, shared with the embedding).
        head = getattr(self, "lm_head", None)
        logits = head(hidden) if head is not None else linear(hidden, self.model.embed_tokens.weight)
        return logits if self.logits_scaling is None else logits / self.logits_scaling

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights of the whole model: this rank's shard
        is sliced out, then q/k/v and gate/up are fused; a missing or
        unexpected tensor is a ValueError. GGUF weights kept in their blocks
        (``PackedWeight``) replace their modules first (``install_packed_weights``).

        The tensors are assigned, not copied: the parameters become the state
        dict's tensors (which must already have the model's dtype), so a model
        built on the meta device is loaded without a second copy of its
        weights. Consumes ``state_dict``: its entries are fused in place, and it
        is empty afterwards."""
        state_dict = install_packed_weights(self, state_dict, _FUSED)
        if self.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)
        if self.tp.world_size > 1:
            split_fused_projections(state_dict, self.config)
        shard = fuse_projections(shard_state_dict(state_dict, self.config, self.tp))
        missing, unexpected = self.load_state_dict(shard, strict=False, assign=True)
        # The parameters now hold the tensors: the dicts let go of them, so a layer
        # replaced after loading (packed_linear) frees its dense weight at once.
        state_dict.clear()
        shard.clear()
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the {self.config.model_type} model: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )


"""Rotary position embeddings, computed as Hugging Face transformers computes them.

The inverse frequencies of every scaled rope type come from transformers' own
``ROPE_INIT_FUNCTIONS`` (the unscaled ones are written out, see
``_default_inv_freq``), so a config scales here exactly as it does there. The
rotation is the "rotate half" (NeoX) layout, or with ``interleaved`` the GPT-J one
that rotates adjacent channel pairs (Cohere 2's); with ``partial_rotary_factor`` < 1
(Phi-4-mini) only the first ``rot_dim`` channels of each head rotate.

Two rope types depend on the length of the sequence the forward pass runs
(transformers' ``dynamic_rope_update``): ``dynamic`` NTK recomputes the
frequencies for seq_len = max position + 1 once that passes
``max_position_embeddings``; ``longrope`` switches from its short to its long
factors once seq_len passes ``original_max_position_embeddings``. Here every
token has its own length, the one Hugging Face sees when it runs that sequence
alone: a decode token's position + 1, a prefill span's context length after
this step (``token_lengths``). Tokens within the window use the plain table and
the fused C++ rotation; only tokens beyond it take the length-dependent
frequencies. Keys already in the pool keep the rotation they were written
with, as in Hugging Face's KV cache.

Multimodal rotary positions (M-RoPE, Qwen2-VL's ``mrope_section``): a step's ``positions``
may be [3, tokens] (time, height, width); frequency j of the rotation then turns by the
position of the section j falls in, as Hugging Face's ``recomposition_frequencies`` picks
it. Each token's row is gathered from the one table, per channel, once per step.

GGUF files carry Llama 3.1+'s scaling as per-dimension divisors of the
inverse frequencies (llama.cpp's ``rope_factors``); the GGUF loader sets them
as ``config.gguf_rope_factors`` and they divide whatever the config computes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.model.shapes import head_dim_of

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# What a step rotates with: each token's row in the cos table, the cos table, the sin table.
StepRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5 keeps ``rope_theta`` and scaling in one dict)."""
    return getattr(config, "rope_parameters", None) or {}


def rope_type_of(config: Any) -> str:
    """The config's rope type; ValueError naming the supported ones for any other."""
    rope_type = rope_parameters_of(config).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return rope_type


def length_threshold(config: Any) -> int | None:
    """The sequence length beyond which a length-dependent rope changes its
    frequencies (None for the others): ``max_position_embeddings`` for dynamic
    NTK, ``original_max_position_embeddings`` for longrope (transformers' rules)."""
    rope_type = rope_type_of(config)
    if rope_type == "dynamic":
        return int(config.max_position_embeddings)
    if rope_type == "longrope":
        return int(rope_parameters_of(config)["original_max_position_embeddings"])
    return None


def context_window_of(config: Any) -> int:
    """The longest sequence the model runs: ``max_position_embeddings``, times
    the factor for dynamic NTK, whose scaling exists to run past that window
    (vLLM's rule for it; the other types keep the config's window)."""
    if rope_type_of(config) == "dynamic":
        return int(config.max_position_embeddings * rope_parameters_of(config)["factor"])
    return int(config.max_position_embeddings)


def rope_inv_freq(config: PretrainedConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling of cos/sin) for a sequence of
    ``seq_len`` tokens (None: the frequencies a model starts with), as
    transformers computes them, divided by the GGUF ``rope_factors`` if any."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_type_of(config)
    if rope_type == "default":
        inv_freq, scaling = _default_inv_freq(config)
    elif rope_type == "dynamic" and seq_len is not None:
        # transformers hands dynamic NTK a tensor length and computes the new base in fp32 from it.
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=torch.tensor(seq_len))
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)
    factors = getattr(config, "gguf_rope_factors", None)
    if factors is not None:
        if len(factors) != inv_freq.numel():
            raise ValueError(f"GGUF rope_freqs has {len(factors)} entries; the rope has {inv_freq.numel()} frequencies")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, scaling


def _default_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """The unscaled frequencies, computed exactly as transformers'
    ``compute_default_rope_parameters`` does (Phi-3's, which honours
    ``partial_rotary_factor``). Written out here because importing
    ``modeling_llama`` pulls in torch._dynamo and, with it, Triton (whose
    nanobind leak report then ends every CPU run)."""
    params = rope_parameters_of(config)
    base = params["rope_theta"]
    dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
             interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin rows [len(positions), rot_dim], as Hugging Face's rotary forward computes them:
    each frequency repeated in the second half (NeoX), or twice in a row (``interleaved``, GPT-J)."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def token_lengths(positions: torch.Tensor, metadata: AttentionMetadata | None) -> torch.Tensor:
    """Each token's sequence length as Hugging Face would see it running that
    sequence alone: a decode token's context length (its position + 1), a
    prefill span's context length after this step. Without metadata the tokens
    are one sequence's forward: max position + 1 for all."""
    if metadata is None:
        return torch.full_like(positions, int(positions.max()) + 1)
    lengths = torch.empty_like(positions)
    lengths[: metadata.num_decodes] = metadata.decode_context_lens
    for span in metadata.prefills:
        lengths[span.query_start : span.query_start + span.query_len] = span.context_len
    return lengths


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position from precomputed cos/sin tables.

    ``cos_cache``/``sin_cache`` hold one row per position ([max_position,
    rot_dim]); for longrope the short-factor rows come first and the
    long-factor rows follow at ``max_position + position`` (twice the table,
    as vLLM keeps it). Dynamic NTK computes the rows of tokens beyond its
    window each step.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int, interleaved: bool = False) -> None:
        super().__init__()
        self.config = config
        self.interleaved = interleaved
        self.rope_type = rope_type_of(config)
        self.threshold = length_threshold(config)
        self.max_position = max_position
        self.mrope_section: list[int] | None = rope_parameters_of(config).get("mrope_section")
        # Length-dependent (or M-RoPE) rows of the step being run, shared by all layers: (that step's metadata, rows).
        self._step: tuple[weakref.ref, StepRows] | None = None
        # Models are built on the meta device and get their weights by assignment;
        # these tables are not weights, so they are computed on the CPU (moved with the model).
        with torch.device("cpu"):
            self._build_tables(head_dim)

    def _build_tables(self, head_dim: int) -> None:
        inv_freq, self.attention_scaling = rope_inv_freq(self.config)
        self.rot_dim = inv_freq.numel() * 2
        if self.rot_dim > head_dim:
            raise ValueError(f"the rope has {self.rot_dim} dimensions, more than head_dim {head_dim}")
        positions = torch.arange(self.max_position)
        cos, sin = _cos_sin(positions, inv_freq, self.attention_scaling, self.interleaved)
        if self.rope_type == "longrope":
            long_inv_freq, _ = rope_inv_freq(self.config, seq_len=self.threshold + 1)
            long_cos, long_sin = _cos_sin(positions, long_inv_freq, self.attention_scaling, self.interleaved)
            cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        if self.mrope_section is not None:  # each channel's section: t, h or w (both halves alike)
            sections = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section))
            self.register_buffer("mrope_channels", torch.cat((sections, sections)), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                metadata: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; positions: [tokens]
        (or M-RoPE's [3, tokens]).
        ``metadata`` gives each token's sequence length (see ``token_lengths``).

        The C++ path rotates q and k in place (they may be views of the fused
        qkv output); the PyTorch path returns new tensors."""
        rows, cos_table, sin_table = self._rows(positions, metadata)
        # The C++ rotation is NeoX's only: the interleaved one runs in PyTorch.
        kernels = None if self.interleaved else cpu_kernels_for(q)
        if kernels is not None:
            kernels.rotary_embedding(rows, q, k, cos_table, sin_table)
            return q, k
        cos = cos_table[rows].to(q.dtype).unsqueeze(1)
        sin = sin_table[rows].to(q.dtype).unsqueeze(1)
        rotate = _rotate_interleaved if self.interleaved else _rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def _rows(self, positions: torch.Tensor, metadata: AttentionMetadata | None) -> StepRows:
        """Each token's row and the tables for this step. Length-dependent ropes work them out
        once per step (the first layer) and reuse them while ``metadata`` is the same object."""
        if self.threshold is None and (self.mrope_section is None or positions.dim() == 1):
            return positions, self.cos_cache, self.sin_cache
        if self._step is not None and metadata is not None and self._step[0]() is metadata:
            return self._step[1]
        if positions.dim() == 2:
            rows = self._mrope_rows(positions)
            if metadata is not None:
                self._step = (weakref.ref(metadata), rows)
            return rows
        lengths = token_lengths(positions, metadata)
        beyond = lengths > self.threshold
        if not bool(beyond.any()):
            rows = (positions, self.cos_cache, self.sin_cache)
        elif self.rope_type == "longrope":
            rows = (positions + beyond * self.max_position, self.cos_cache, self.sin_cache)
        else:
            rows = self._dynamic_rows(positions, lengths, beyond)
        if metadata is not None:
            self._step = (weakref.ref(metadata), rows)
        return rows

    def _mrope_rows(self, positions: torch.Tensor) -> StepRows:
        """One cos/sin row per token: channel j read at the token's position of its section."""
        if self.mrope_section is None:
            raise ValueError("[3, tokens] positions need the config's rope_parameters mrope_section (M-RoPE)")
        channels = self.mrope_channels
        by_channel = positions[channels].T.contiguous()  # [tokens, rot_dim] (so the rows gathered are contiguous)
        arange = torch.arange(channels.numel(), device=positions.device)
        return (torch.arange(positions.shape[1], device=positions.device), self.cos_cache[by_channel, arange],
                self.sin_cache[by_channel, arange])

    def _dynamic_rows(self, positions: torch.Tensor, lengths: torch.Tensor, beyond: torch.Tensor) -> StepRows:
        """One cos/sin row per token: the table's within the window, and beyond
        it the frequencies dynamic NTK computes for that token's length."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        beyond_rows = beyond.nonzero().flatten()
        for length in lengths[beyond_rows].unique().tolist():
            rows = beyond_rows[lengths[beyond_rows] == length]
            inv_freq, scaling = rope_inv_freq(self.config, seq_len=length)
            row_cos, row_sin = _cos_sin(positions[rows].cpu(), inv_freq, scaling, self.interleaved)
            cos[rows], sin[rows] = row_cos.to(cos), row_sin.to(sin)
        return torch.arange(positions.numel(), device=positions.device), cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotation of the first ``cos.shape[-1]`` channels; the rest pass through."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Cohere 2's rotation of adjacent channel pairs (x[2i], x[2i+1]), computed as Hugging Face's
    is: in fp32 from cos/sin already rounded to x's dtype, rounded to x's dtype once at the end."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    out = (x_rot * cos.float() + rotated * sin.float()).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1)

"""Encoder-only BERT-family models (BERT, RoBERTa, XLM-RoBERTa) over packed batches.

A packed batch is the concatenation of its sequences' tokens: no padding, so every
linear layer runs on exactly the real tokens. Attention is bidirectional and stays
inside each sequence (block-diagonal): ``packed_attention`` runs it over the packed rows
in a C++ kernel where one is built, else pads only the attention inputs, per run of
sequences of similar length, for one PyTorch ``scaled_dot_product_attention`` call per run.

Weights are the Hugging Face parameter names of ``BertModel`` /
``XLMRobertaModel`` (optionally under ``bert.`` / ``roberta.``) and of their
``*ForSequenceClassification`` heads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.model.encoder_linear import linear, linear_add, linear_gelu


@dataclass(frozen=True)
class PackedBatch:
    """The tokens of several sequences, concatenated: ``seq_lens[i]`` tokens each, in order."""

    input_ids: torch.Tensor       # [T] int64
    token_type_ids: torch.Tensor  # [T] int64 (zeros where a sequence has no segments)
    positions: torch.Tensor       # [T] int64, 0-based within each sequence
    seq_lens: tuple[int, ...]

    @classmethod
    def build(cls, token_ids: list[list[int]], token_type_ids: list[list[int] | None]) -> PackedBatch:
        lens = tuple(len(ids) for ids in token_ids)
        flat_types = [t for ids, types in zip(token_ids, token_type_ids) for t in (types or [0] * len(ids))]
        return cls(input_ids=torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long),
                   token_type_ids=torch.tensor(flat_types, dtype=torch.long),
                   positions=torch.cat([torch.arange(n) for n in lens]),
                   seq_lens=lens)

    def starts(self) -> torch.Tensor:
        """The index of each sequence's first token in the packed batch."""
        lens = torch.tensor(self.seq_lens)
        return torch.cumsum(lens, 0) - lens


# A group of sequences is padded to its longest for attention while the padded size stays
# within this factor of the real tokens.
PADDING_SLACK = 1.25


def padding_groups(seq_lens: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Consecutive runs of ``seq_lens`` whose padding to their longest costs at most PADDING_SLACK
    (the runner sorts a batch by length, so a run is usually the whole batch)."""
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    longest = real = 0
    for length in seq_lens:
        if current and max(longest, length) * (len(current) + 1) > PADDING_SLACK * (real + length):
            groups.append(tuple(current))
            current, longest, real = [], 0, 0
        current.append(length)
        longest, real = max(longest, length), real + length
    groups.append(tuple(current))
    return groups


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...],
                      window: int | None) -> torch.Tensor:
    """One SDPA call over a few sequences padded to the longest, pad keys masked out."""
    count, longest = len(seq_lens), max(seq_lens)
    _, heads, head_dim = q.shape
    valid = torch.arange(longest)[None, :] < torch.tensor(seq_lens)[:, None]  # [B, L]
    index = valid.view(-1).nonzero().squeeze(1)  # each packed token's row in the padded [B * L]

    def padded(x: torch.Tensor) -> torch.Tensor:
        buffer = x.new_zeros(count * longest, heads, head_dim).index_copy_(0, index, x)
        return buffer.view(count, longest, heads, head_dim).transpose(1, 2)

    mask = valid[:, None, None, :]
    if window is not None and longest > window + 1:
        pos = torch.arange(longest)
        mask = mask & ((pos[:, None] - pos[None, :]).abs() <= window)
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(count * longest, heads * head_dim).index_select(0, index)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...],
                     window: int | None = None) -> torch.Tensor:
    """Bidirectional attention within each sequence of a packed batch.

    ``q``, ``k``, ``v``: ``[T, heads, head_dim]`` (views of a fused QKV output will do);
    returns ``[T, heads * head_dim]``. ``window``: a token sees only tokens at most ``window``
    positions away (ModernBERT's local layers); None: the whole sequence.

    On an AVX-512 CPU the C++ kernel (``varlen_attention``) reads the packed rows in place
    and writes the packed output: no padding, no copies. Elsewhere sequences of similar length
    share one SDPA call, padded to the longest (``padding_groups``): on CPU that costs about
    3.5x less than one call per sequence (measured on runner-sized batches of 10-256 tokens),
    whose per-call overhead dominates at these lengths.
    """
    total, heads, head_dim = q.shape
    kernels = cpu_kernels_for(q)
    if (kernels is not None and head_dim % 16 == 0 and kernels.varlen_attention_available(q.dtype)
            and all(x.stride(2) == 1 for x in (q, k, v))):
        offsets = torch.tensor((0, *itertools.accumulate(seq_lens)), dtype=torch.long)
        return kernels.varlen_attention(q, k, v, offsets, head_dim ** -0.5, -1 if window is None else window)
    out = torch.empty(total, heads * head_dim, dtype=q.dtype)
    start = 0
    for group in padding_groups(seq_lens):
        end = start + sum(group)
        out[start:end] = _padded_attention(q[start:end], k[start:end], v[start:end], group, window)
        start = end
    return out


def strip_prefix(weights: dict[str, torch.Tensor], probe: str, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The encoder's own weights under their base-model names: a classifier checkpoint stores
    them under a prefix (``bert.``), a base model without; the other keys (heads) keep theirs."""
    for prefix in prefixes:
        if prefix + probe in weights:
            return {name[len(prefix):] if name.startswith(prefix) else name: tensor
                    for name, tensor in weights.items()}
    raise ValueError(f"the checkpoint has no {probe!r} (looked under prefixes {list(prefixes)}): "
                     "is it a BERT-family encoder checkpoint?")


def take_weight(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ValueError(f"the checkpoint is missing weight {name!r}")
    return weights[name]


class BertEncoder:
    """BERT / RoBERTa / XLM-RoBERTa: absolute position and token-type embeddings, post-norm layers."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor], roberta: bool) -> None:
        kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported; only 'absolute' is")
        self.heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.eps = config.layer_norm_eps
        self.act = ACT2FN[config.hidden_act]
        # BERT's "gelu" is the exact (erf) GELU, which the up projection applies in its epilogue.
        self.exact_gelu = config.hidden_act == "gelu"
        # RoBERTa numbers positions after its padding index (position 0 is token padding_idx + 1).
        self.position_offset = config.pad_token_id + 1 if roberta else 0
        self.max_len = config.max_position_embeddings - self.position_offset
        w = weights
        self.word = take_weight(w, "embeddings.word_embeddings.weight")
        self.pos = take_weight(w, "embeddings.position_embeddings.weight")
        self.types = take_weight(w, "embeddings.token_type_embeddings.weight")
        self.num_token_types = self.types.shape[0]
        self.emb_norm = (take_weight(w, "embeddings.LayerNorm.weight"), take_weight(w, "embeddings.LayerNorm.bias"))
        self.layers = [self._layer(w, f"encoder.layer.{i}.") for i in range(config.num_hidden_layers)]

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], p: str) -> dict[str, torch.Tensor]:
        qkv = [f"{p}attention.self.{name}" for name in ("query", "key", "value")]
        return {
            # One fused QKV matmul instead of three: fewer, larger GEMMs.
            "qkv_w": torch.cat([take_weight(w, n + ".weight") for n in qkv]),
            "qkv_b": torch.cat([take_weight(w, n + ".bias") for n in qkv]),
            "o_w": take_weight(w, p + "attention.output.dense.weight"), "o_b": take_weight(w, p + "attention.output.dense.bias"),
            "ln1_w": take_weight(w, p + "attention.output.LayerNorm.weight"),
            "ln1_b": take_weight(w, p + "attention.output.LayerNorm.bias"),
            "up_w": take_weight(w, p + "intermediate.dense.weight"), "up_b": take_weight(w, p + "intermediate.dense.bias"),
            "down_w": take_weight(w, p + "output.dense.weight"), "down_b": take_weight(w, p + "output.dense.bias"),
            "ln2_w": take_weight(w, p + "output.LayerNorm.weight"), "ln2_b": take_weight(w, p + "output.LayerNorm.bias"),
        }

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The last hidden states of every token, ``[T, hidden_size]``."""
        x = (self.word[batch.input_ids] + self.pos[batch.positions + self.position_offset]
             + self.types[batch.token_type_ids])
        x = F.layer_norm(x, (self.hidden_size,), *self.emb_norm, self.eps)
        head_dim = self.hidden_size // self.heads
        for layer in self.layers:
            qkv = linear(x, layer["qkv_w"], layer["qkv_b"]).view(-1, 3, self.heads, head_dim)
            attn = packed_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], batch.seq_lens)
            x = F.layer_norm(linear_add(attn, x, layer["o_w"], layer["o_b"]), (self.hidden_size,),
                             layer["ln1_w"], layer["ln1_b"], self.eps)
            up = (linear_gelu(x, layer["up_w"], layer["up_b"]) if self.exact_gelu
                  else self.act(linear(x, layer["up_w"], layer["up_b"])))
            x = F.layer_norm(linear_add(up, x, layer["down_w"], layer["down_b"]), (self.hidden_size,),
                             layer["ln2_w"], layer["ln2_b"], self.eps)
        return x


class TanhClassifierHead:
    """A dense + tanh over the first token, then the output layer: ``BertForSequenceClassification``
    (``pooler.dense``, ``classifier``) and ``(XLM)RobertaForSequenceClassification``
    (``classifier.dense``, ``classifier.out_proj``)."""

    NAMES = {"bert": ("pooler.dense", "classifier"), "roberta": ("classifier.dense", "classifier.out_proj")}

    def __init__(self, weights: dict[str, torch.Tensor], family: str) -> None:
        dense, out = self.NAMES[family]
        self.dense_w, self.dense_b = take_weight(weights, dense + ".weight"), take_weight(weights, dense + ".bias")
        self.out_w, self.out_b = take_weight(weights, out + ".weight"), take_weight(weights, out + ".bias")

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        pooled = torch.tanh(F.linear(hidden[batch.starts()], self.dense_w, self.dense_b))
        return F.linear(pooled, self.out_w, self.out_b)

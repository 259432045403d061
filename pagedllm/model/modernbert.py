"""ModernBERT (``ModernBertModel`` / ``ModernBertForSequenceClassification``) over packed batches.

Pre-norm layers, rotary positions (one rope base for global layers, another for local
ones), a gated GELU MLP, and local layers that see only tokens within
``local_attention // 2`` positions. Attention is ``bert.packed_attention``: per sequence,
bidirectional, no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedllm.model.bert import PackedBatch, take_weight, packed_attention


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout; ``x`` is ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class ModernBertEncoder:
    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> None:
        self.heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.eps = config.norm_eps
        self.act = ACT2FN[config.hidden_activation]
        self.max_len = config.max_position_embeddings
        # No segment embeddings: token_type_ids are ignored, as transformers' ModernBERT ignores them.
        self.num_token_types = None
        self.layer_types = list(config.layer_types)
        self.window = config.local_attention // 2
        self.inv_freq = {}
        for kind in set(self.layer_types):
            rope = config.rope_parameters[kind]
            if rope.get("rope_type", "default") != "default":
                raise ValueError(f"ModernBERT rope_type {rope['rope_type']!r} is not supported; only 'default' is")
            steps = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
            self.inv_freq[kind] = 1.0 / (rope["rope_theta"] ** steps)
        w = weights
        self.embed = take_weight(w, "embeddings.tok_embeddings.weight")
        self.emb_norm = self._norm(w, "embeddings.norm")
        self.final_norm = self._norm(w, "final_norm")
        self.layers = [self._layer(w, f"layers.{i}.", i) for i in range(config.num_hidden_layers)]

    @staticmethod
    def _norm(w: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return take_weight(w, name + ".weight"), w.get(name + ".bias")  # norm_bias=False saves no bias

    def _layer(self, w: dict[str, torch.Tensor], p: str, index: int) -> dict:
        return {
            "attn_norm": None if index == 0 else self._norm(w, p + "attn_norm"),  # layer 0 has none
            "qkv_w": take_weight(w, p + "attn.Wqkv.weight"), "qkv_b": w.get(p + "attn.Wqkv.bias"),
            "o_w": take_weight(w, p + "attn.Wo.weight"), "o_b": w.get(p + "attn.Wo.bias"),
            "mlp_norm": self._norm(w, p + "mlp_norm"),
            "wi_w": take_weight(w, p + "mlp.Wi.weight"), "wi_b": w.get(p + "mlp.Wi.bias"),
            "wo_w": take_weight(w, p + "mlp.Wo.weight"), "wo_b": w.get(p + "mlp.Wo.bias"),
            "type": self.layer_types[index],
        }

    def _layer_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), norm[0], norm[1], self.eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The last hidden states of every token, ``[T, hidden_size]``."""
        x = self._layer_norm(self.embed[batch.input_ids], self.emb_norm)
        rope = {}
        for kind, inv_freq in self.inv_freq.items():
            freqs = batch.positions[:, None].float() * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # broadcast over heads
            rope[kind] = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        for layer in self.layers:
            h = x if layer["attn_norm"] is None else self._layer_norm(x, layer["attn_norm"])
            qkv = F.linear(h, layer["qkv_w"], layer["qkv_b"]).view(-1, 3, self.heads, self.head_dim)
            cos, sin = rope[layer["type"]]
            q, k = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin)
            window = self.window if layer["type"] == "sliding_attention" else None
            attn = packed_attention(q, k, qkv[:, 2], batch.seq_lens, window)
            x = x + F.linear(attn, layer["o_w"], layer["o_b"])
            gate_in, gate = F.linear(self._layer_norm(x, layer["mlp_norm"]), layer["wi_w"], layer["wi_b"]).chunk(2, -1)
            x = x + F.linear(self.act(gate_in) * gate, layer["wo_w"], layer["wo_b"])
        return self._layer_norm(x, self.final_norm)


class ModernBertClassifierHead:
    """``ModernBertForSequenceClassification``: CLS or mean pooling, dense + act + norm, classifier."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> None:
        if config.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {config.classifier_pooling!r} is not supported (cls, mean)")
        self.pooling = config.classifier_pooling
        self.act = ACT2FN[config.classifier_activation]
        self.eps, self.hidden_size = config.norm_eps, config.hidden_size
        self.dense_w, self.dense_b = take_weight(weights, "head.dense.weight"), weights.get("head.dense.bias")
        self.norm_w, self.norm_b = take_weight(weights, "head.norm.weight"), weights.get("head.norm.bias")
        self.out_w, self.out_b = take_weight(weights, "classifier.weight"), take_weight(weights, "classifier.bias")

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if self.pooling == "cls":
            pooled = hidden[batch.starts()]
        else:
            pooled = torch.stack([part.mean(0) for part in hidden.split(list(batch.seq_lens))])
        pooled = F.layer_norm(self.act(F.linear(pooled, self.dense_w, self.dense_b)), (self.hidden_size,),
                              self.norm_w, self.norm_b, self.eps)
        return F.linear(pooled, self.out_w, self.out_b)

"""Each family's router, exactly as Hugging Face computes it (transformers 5.x).

The router is one linear layer (``gate``: [num_experts, hidden]; a bias only in gpt-oss) whose
logits, in the model's dtype, pick ``top_k`` experts per token and weigh them:
- ``softmax_topk`` (Qwen2-MoE, Qwen3-MoE, OLMoE): softmax over all experts in fp32, the
  top k probabilities, divided by their sum when ``norm_topk_prob``; the weights are
  rounded to the model's dtype.
- ``mixtral``: the same softmax and top k, always renormalised, and the weights stay fp32
  (the experts' bf16 outputs are multiplied in fp32, then rounded).
- ``topk_softmax`` (Granite-MoE, gpt-oss): the top k of the fp32 logits, then a softmax over
  those k alone, rounded to the model's dtype (gpt-oss's softmax runs in the logits' dtype,
  which for bf16 is the fp32 softmax rounded once: the same weights).
Ties go as ``torch.topk`` breaks them, the op Hugging Face calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUTINGS = ("softmax_topk", "mixtral", "topk_softmax")


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into (expert ids, weights)."""

    kind: str  # one of ROUTINGS
    top_k: int
    renormalize: bool = False  # softmax_topk's norm_topk_prob

    def __post_init__(self) -> None:
        if self.kind not in ROUTINGS:
            raise ValueError(f"unknown routing {self.kind!r}; known: {', '.join(ROUTINGS)}")

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [tokens, top_k] int64, weights [tokens, top_k]) for logits [tokens, experts]."""
        if self.kind == "topk_softmax":
            top_logits, indices = logits.float().topk(self.top_k, dim=-1)
            return indices, torch.softmax(top_logits, dim=-1).to(logits.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.kind == "mixtral" or self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights if self.kind == "mixtral" else weights.to(logits.dtype)


def routing_of(config) -> Routing:
    """The routing of a transformers MoE config (its ``model_type``)."""
    model_type = config.model_type
    top_k = config.num_experts_per_tok
    if model_type == "mixtral":
        return Routing("mixtral", top_k)
    if model_type in ("granitemoe", "gpt_oss"):
        return Routing("topk_softmax", top_k)
    return Routing("softmax_topk", top_k, bool(getattr(config, "norm_topk_prob", False)))

"""Checkpoint names of expert weights -> the stacked parameters the model holds.

What ``save_pretrained`` writes (transformers 5.x saves the hub's original layout):
- Qwen2-MoE, Qwen3-MoE, OLMoE: ``mlp.experts.{e}.{gate,up,down}_proj.weight``, router
  ``mlp.gate.weight``, Qwen2-MoE's ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
  ``mlp.shared_expert_gate.weight``;
- Mixtral: ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (gate, up, down), router
  ``block_sparse_moe.gate.weight``;
- Granite-MoE: already stacked, ``block_sparse_moe.input_linear.weight`` [E, 2I, H] (gate
  rows first), ``block_sparse_moe.output_linear.weight`` [E, H, I], router
  ``block_sparse_moe.router.layer.weight``.
- gpt-oss: stacked ``mlp.experts.{gate_up,down}_proj`` and their ``_bias``, router
  ``mlp.router.{weight,bias}`` (its transposed, interleaved layout: ``model.gpt_oss``).
transformers' in-memory names (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``,
``router.weight``) are accepted too. Everything lands under ``mlp.``: ``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, ``mlp.shared_expert.gate_up_proj.weight``.
"""

from __future__ import annotations

import re

import torch

# Renamed one for one (a substring of the name -> its replacement), in this order.
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
    (".mlp.router.layer.weight", ".mlp.gate.weight"),
    (".mlp.router.weight", ".mlp.gate.weight"),
    (".mlp.router.bias", ".mlp.gate.bias"),
    (".mlp.experts.gate_up_proj.weight", ".mlp.experts.gate_up_proj"),
    (".mlp.experts.down_proj.weight", ".mlp.experts.down_proj"),
)
# Per-expert projection names -> gate, up, down.
_PER_EXPERT = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def stack_expert_weights(state_dict: dict[str, torch.Tensor]) -> None:
    """Rename and stack a checkpoint's expert weights in place (see the module docstring);
    ValueError for a layer whose experts are not all there."""
    for name in list(state_dict):
        new = name
        for old, replacement in _RENAMES:
            new = new.replace(old, replacement)
        if new != name:
            state_dict[new] = state_dict.pop(name)
    experts: dict[str, dict[tuple[int, str], str]] = {}
    for name in list(state_dict):
        match = _EXPERT_NAME.match(name)
        if match and match.group(3) in _PER_EXPERT:
            experts.setdefault(match.group(1), {})[(int(match.group(2)), _PER_EXPERT[match.group(3)])] = name
    for prefix, parts in experts.items():
        count = 1 + max(expert for expert, _ in parts)
        if len(parts) != 3 * count:
            raise ValueError(f"{prefix}: expected gate, up and down weights of experts 0..{count - 1}, "
                             f"found {len(parts)} tensors")
        tensors = {key: state_dict.pop(name) for key, name in parts.items()}
        state_dict[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[(e, "gate")], tensors[(e, "up")]]) for e in range(count)])
        state_dict[f"{prefix}.down_proj"] = torch.stack([tensors[(e, "down")] for e in range(count)])
    _fuse_shared_expert(state_dict)


def _fuse_shared_expert(state_dict: dict[str, torch.Tensor]) -> None:
    """Qwen2-MoE's shared expert: its gate and up weights as one ``gate_up_proj`` (the dense MLP's layout)."""
    for name in [n for n in state_dict if n.endswith(".mlp.shared_expert.gate_proj.weight")]:
        prefix = name.removesuffix(".gate_proj.weight")
        up = state_dict.pop(f"{prefix}.up_proj.weight")
        state_dict[f"{prefix}.gate_up_proj.weight"] = torch.cat([state_dict.pop(name), up])

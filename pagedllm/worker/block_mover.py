"""Carries out a step's ``BlockMovePlan`` over the stores registered with it.

One mover per pool: the model runner's (every rank), and a speculative draft
model's (its own pool over the same block ids). The stores are the pool's slot
caches (copies; an int8 pool's tail slots), its ``HostKVStore`` (swaps, and
the host tier's entries), on the driver with tiers ``RunnerTiers`` (the host
tier's offloads, loads and drops, the disk tier's persists) and, with LoRA,
the runner's ``RunnerAdapters`` (adapter page-ins). The order is
``core.block_moves.Phase``, nowhere else: ``before_forward`` runs the phases
before ``Phase.FORWARD``, ``after_forward`` those after it.

A phase whose store is not registered is skipped: a pool without tiers (a
draft's; tensor-parallel ranks, which the tiers refuse) has no tier entries to
move, a pool without tail slots (a draft's) has no tails, and a draft runs
no adapters. A draft's pool
then reads stale K/V for such blocks, which can only lower its acceptance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.core.block_moves import BlockMovePlan, CopyBlock, Phase
from pagedllm.kv_tiers.host import HostKVStore
from pagedllm.kv_tiers.runner_tiers import RunnerTiers
from pagedllm.worker.lora_adapters import RunnerAdapters

_TIER_PHASES = frozenset({Phase.TIER_OFFLOAD, Phase.TIER_LOAD, Phase.TIER_DROP, Phase.TIER_PERSIST})
_TAIL_PHASES = frozenset({Phase.TAIL_OUT, Phase.TAIL_COPY, Phase.TAIL_IN, Phase.TAIL_FILL})


class BlockMover:
    def __init__(self, kv_caches: list[LayerKVCache], host: HostKVStore) -> None:
        self.kv_caches = kv_caches
        self.host = host
        self.tiers: RunnerTiers | None = None  # ``attach_tiers``
        self.adapters: RunnerAdapters | None = None  # the runner's, with LoRA
        self.has_tails = bool(kv_caches) and kv_caches[0].tail_key is not None
        # Stores are looked up when a phase runs, so one attached (or replaced) later is used.
        self._handlers: dict[Phase, Callable[[list], None]] = {
            Phase.TIER_OFFLOAD: lambda moves: self.tiers.offload(self.kv_caches, moves),
            Phase.SWAP_OUT: lambda moves: self.host.swap_out(self.kv_caches, moves),
            Phase.COPY: lambda moves: copy_blocks(self.kv_caches, moves),
            Phase.SWAP_IN: lambda moves: self.host.swap_in(self.kv_caches, moves),
            Phase.TIER_LOAD: lambda moves: self.tiers.load(self.kv_caches, moves),
            Phase.TIER_DROP: lambda moves: self.tiers.drop(self.kv_caches, moves),
            Phase.TAIL_OUT: lambda moves: self.host.swap_out_tails(self.kv_caches, moves),
            Phase.TAIL_COPY: lambda moves: _per_layer(self.kv_caches, moves, LayerKVCache.copy_tails),
            Phase.TAIL_IN: lambda moves: self.host.swap_in_tails(self.kv_caches, moves),
            Phase.TAIL_FILL: lambda moves: _per_layer(self.kv_caches, moves, LayerKVCache.fill_tails),
            Phase.ADAPTER_LOAD: lambda moves: self.adapters.load(moves),
            Phase.TIER_PERSIST: lambda moves: self.tiers.persist(self.kv_caches, moves),
        }

    def attach_tiers(self, tiers: RunnerTiers) -> None:
        self.tiers = tiers

    def before_forward(self, plan: BlockMovePlan) -> None:
        self._carry_out(plan.phases(before=Phase.FORWARD))

    def after_forward(self, plan: BlockMovePlan) -> None:
        self._carry_out(plan.phases(after=Phase.FORWARD))

    def _carry_out(self, phases: Iterator[tuple[Phase, list]]) -> None:
        for phase, moves in phases:
            if (phase in _TIER_PHASES and self.tiers is None) or (phase in _TAIL_PHASES and not self.has_tails) \
                    or (phase is Phase.ADAPTER_LOAD and self.adapters is None):
                continue
            self._handlers[phase](moves)


def copy_blocks(kv_caches: list[LayerKVCache], copies: list[CopyBlock]) -> None:
    """Copy whole physical blocks, every slot cache. The gather reads all sources
    before the scatter writes, so the copies of one step never see each other's results."""
    _per_layer(kv_caches, copies, _copy_layer_blocks)


def _copy_layer_blocks(layer: LayerKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    for tensor in layer.tensors():  # K, V and, when quantized, their scales
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


def _per_layer(kv_caches: list[LayerKVCache], pairs: list[tuple[int, int]], move) -> None:
    """``move(layer, firsts, seconds)`` of ``pairs`` as index tensors, every slot cache."""
    if not pairs:
        return
    device = kv_caches[0].key.device
    firsts = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    seconds = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    for layer in kv_caches:
        move(layer, firsts, seconds)

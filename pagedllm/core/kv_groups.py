"""KV cache groups: which layers share a block table (no torch).

Layers are grouped by how they attend (vLLM v1's KV cache groups): a
full-attention layer reads every earlier token, a sliding-window layer of
window ``W`` only the last ``W``, a chunked local layer of chunk ``C`` (Llama 4)
only the earlier tokens of its own ``C``-token chunk. Each group has its own block
table per request, all in one shared pool, so a sliding or chunked group can give
back the blocks no later query reads while the full group keeps every block. Each
kind's rules are its module's in ``core/kv_managers/``.

One pool needs one block size in bytes, so every group has the same number of
layers (vLLM's uniform page size): the kinds' layer lists are cut into groups
of ``group_size`` layers, the smallest kind's count, and a block holds one
block of K/V for each of ``num_slots`` (= ``group_size``) layers. Layer
``layers[i]`` of a group reads and writes slot ``i`` of that group's blocks: the
runner keeps ``num_slots`` KV tensors and layer ``l`` uses tensor
``slot_of_layer[l]`` through the table of group ``group_of_layer[l]``. A group
with fewer layers (the last of a kind whose count is not a multiple) leaves
its blocks' remaining slots unused.

Gemma 3 (5 sliding layers of every 6) with 18 layers: one full group of the 3
global layers and 5 sliding groups of 3; a block holds 3 layers, and at 16k
tokens a request holds 1/6 of its full-attention blocks plus 5 windows.
Without the hybrid manager (``hybrid=False``) there is one group of every
layer, which keeps every block unless every layer slides with one window
(Mistral), as before groups existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pagedllm.core.kv_managers.chunked_local import ChunkedLocal
from pagedllm.core.kv_managers.full_attention import FullAttention
from pagedllm.core.kv_managers.kinds import AttentionKind, LayerAttention, attention_of
from pagedllm.core.kv_managers.sliding_window import SlidingWindow
from pagedllm.utils import cdiv

GroupKind = Literal["full", "sliding_window", "chunked_local"]


@dataclass(frozen=True)
class KVGroupSpec:
    """One group: its layers (model layer indices, in slot order) and how they attend."""

    kind: GroupKind
    layers: tuple[int, ...]
    window: int | None = None  # sliding_window only: a query at p sees keys p - window < j <= p
    chunk: int | None = None  # chunked_local only: a query at p sees keys p // chunk * chunk <= j <= p

    def __post_init__(self) -> None:
        if (self.kind == "sliding_window") != (self.window is not None):
            raise ValueError(f"a {self.kind} group takes a window only when it slides, got window={self.window!r}")
        if (self.kind == "chunked_local") != (self.chunk is not None):
            raise ValueError(f"a {self.kind} group takes a chunk only when it is chunked_local, got chunk={self.chunk!r}")
        if not self.layers:
            raise ValueError("a KV group needs at least one layer")

    @property
    def attention(self) -> AttentionKind:
        """The kind whose rules (``core/kv_managers/``) this group's tables follow."""
        if self.window is not None:
            return SlidingWindow(self.window)
        return FullAttention() if self.chunk is None else ChunkedLocal(self.chunk)

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds in this group once the
        next token's window or chunk has moved past the earlier ones (the bench's and
        the start-up line's arithmetic; the manager's rule is the kind's ``num_released``)."""
        return cdiv(num_tokens, block_size) - self.attention.num_released(num_tokens, block_size)

    def most_blocks_held(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once in this group
        when no step computes more than ``max_step_tokens`` of it (admission's bound;
        each kind's ``most_blocks_held``)."""
        return self.attention.most_blocks_held(num_tokens, block_size, max_step_tokens)

    def describe(self) -> str:
        return f"{self.attention.describe()}, layers {','.join(map(str, self.layers))}"


@dataclass(frozen=True)
class KVGroupLayout:
    """Every layer's group and slot (see the module docstring). Group 0 is a
    full-attention group whenever the model has one: its blocks are the ones KV
    events announce and the offload tiers keep (they cover every token)."""

    groups: tuple[KVGroupSpec, ...]
    num_layers: int

    def __post_init__(self) -> None:
        seen = sorted(layer for group in self.groups for layer in group.layers)
        if seen != list(range(self.num_layers)):
            raise ValueError(f"KV groups must cover layers 0..{self.num_layers - 1} once each, got {seen}")
        sizes = {len(group.layers) for group in self.groups}
        if len(self.groups) > 1 and max(sizes) != len(self.groups[0].layers):
            raise ValueError("the first KV group must be one of the largest (its size is the block's slots)")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Layers' K/V one block holds: the largest group's layer count."""
        return max(len(group.layers) for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        owner = [0] * self.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = index
        return tuple(owner)

    @property
    def slot_of_layer(self) -> tuple[int, ...]:
        slot = [0] * self.num_layers
        for group in self.groups:
            for position, layer in enumerate(group.layers):
                slot[layer] = position
        return tuple(slot)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention or chunked), in group order."""
        return tuple(group.window for group in self.groups)

    @property
    def kinds(self) -> tuple[AttentionKind, ...]:
        """Each group's attention kind, in group order (what the KV cache manager takes)."""
        return tuple(group.attention for group in self.groups)

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Pool blocks a request of ``num_tokens`` tokens holds over all groups."""
        return sum(group.blocks_held(num_tokens, block_size) for group in self.groups)

    def most_blocks_held(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """Pool blocks a request of ``num_tokens`` tokens may hold at once over all groups
        (``KVGroupSpec.most_blocks_held``): what admission checks against the pool."""
        return sum(group.most_blocks_held(num_tokens, block_size, max_step_tokens) for group in self.groups)

    def describe(self, bytes_per_layer_token: int) -> str:
        """The start-up line's part: the groups, runs of one kind merged, and what a
        token costs the pool in each (every group's block has ``num_slots`` slots)."""
        runs: list[list[int]] = []
        for index, group in enumerate(self.groups):
            if runs and self.groups[runs[-1][-1]].attention == group.attention:
                runs[-1].append(index)
            else:
                runs.append([index])
        clauses = []
        for run in runs:
            what = self.groups[run[0]].attention.describe_reach()
            layers = sorted(layer for index in run for layer in self.groups[index].layers)
            name = f"group {run[0]}" if len(run) == 1 else f"groups {_ranges(run)}"
            clauses.append(f"{name} {what} (layers {_ranges(layers)})")
        return (f"{self.num_groups} KV cache groups of {bytes_per_layer_token * self.num_slots} B/token: "
                + "; ".join(clauses))


def _ranges(numbers: Sequence[int]) -> str:
    """Sorted integers as runs: [0, 1, 2, 4, 6, 7] -> "0-2,4,6-7"."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1][-1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def kv_group_layout(layer_windows: Sequence[LayerAttention], hybrid: bool = True) -> KVGroupLayout:
    """The groups of a model whose layer ``l`` attends as ``layer_windows[l]`` says: None
    (full attention), a sliding window ``W`` (``model.shapes.sliding_windows_of``) or a kind
    such as ``ChunkedLocal(C)`` (``core.kv_managers.kinds``).

    One group when every layer attends alike (all full: Llama; all sliding with one
    window: Mistral) or when ``hybrid`` is off (``disable_hybrid_kv_cache_manager``:
    then a model that mixes kinds keeps every block of every layer). Otherwise the
    layers of each kind (full, then each window, smallest first, then each chunk size)
    in order, cut into groups of the smallest kind's layer count."""
    num_layers = len(layer_windows)
    if num_layers == 0:
        raise ValueError("a model needs at least one layer")
    kinds: dict[AttentionKind, list[int]] = {}
    for layer, spelling in enumerate(layer_windows):
        try:
            kind = attention_of(spelling)
        except ValueError as error:
            raise ValueError(f"layer {layer}'s attention: {error}") from None
        kinds.setdefault(kind, []).append(layer)
    if len(kinds) == 1 or not hybrid:
        (kind,) = kinds if len(kinds) == 1 else (FullAttention(),)
        return KVGroupLayout((_group(kind, tuple(range(num_layers))),), num_layers)
    group_size = min(len(layers) for layers in kinds.values())
    ordered = sorted(kinds.items(), key=lambda item: _order(item[0]))
    groups = [_group(kind, tuple(layers[start:start + group_size]))
              for kind, layers in ordered for start in range(0, len(layers), group_size)]
    return KVGroupLayout(tuple(groups), num_layers)


def _order(kind: AttentionKind) -> tuple[int, int]:
    """Full attention first (group 0 covers every token), then windows, then chunks, smallest first."""
    if isinstance(kind, SlidingWindow):
        return 1, kind.window
    return (2, kind.chunk) if isinstance(kind, ChunkedLocal) else (0, 0)


def _group(kind: AttentionKind, layers: tuple[int, ...]) -> KVGroupSpec:
    if isinstance(kind, SlidingWindow):
        return KVGroupSpec("sliding_window", layers, window=kind.window)
    if isinstance(kind, ChunkedLocal):
        return KVGroupSpec("chunked_local", layers, chunk=kind.chunk)
    return KVGroupSpec("full", layers)

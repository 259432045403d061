"""The KV-cache arithmetic behind paging, as `pagedllm explain` prints it.

Pure integers (no torch): bytes per token and per block, what a pool holds,
what a contiguous reservation costs and wastes, block-table sizes, the
block-size trade-off, and the savings of sharing a prompt or a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.kv_groups import KVGroupLayout, kv_group_layout
from pagedllm.core.kv_managers.kinds import LayerAttention
from pagedllm.utils import cdiv

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KIB, MIB, GIB = 2**10, 2**20, 2**30


def human(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, trailing zeros dropped."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{num_bytes:,.0f} bytes"


def _token_bytes(tokens: int, per_token: int) -> str:
    """``tokens x bytes per token = total``, the product several explain lines show."""
    return f"{tokens:,} x {human(per_token)} = {human(tokens * per_token)}"


def _waste_percent(allocated: int, used: int) -> str:
    """The share of ``allocated`` that ``used`` leaves idle."""
    return f"{100 * (allocated - used) / allocated:.1f}%"


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def explain(shape: KVShape, *, context: int = 4096, chat_tokens: int = 300, pool_bytes: int | None = None,
            n: int = 4, prompt_tokens: int = 2000, sessions: int = 500, shared_prefix_tokens: int = 3000,
            block_sizes: tuple[int, ...] = (8, 16, 32, 64, 128)) -> list[str]:
    """The lines `pagedllm explain` prints, each with the formula that gives it."""
    per_token, per_block, bs = shape.bytes_per_token, shape.bytes_per_block, shape.block_size
    elem = DTYPE_BYTES[shape.dtype]
    lines = [
        f"KV bytes per token: 2 (K, V) x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
        f"{shape.head_dim} dims x {elem} bytes ({shape.dtype}) = {per_token:,} bytes = {human(per_token)}",
        f"bytes per {bs}-token block: {bs} x {human(per_token)} = {per_block:,} bytes = {human(per_block)}",
    ]
    if pool_bytes is not None:
        blocks = pool_bytes // per_block
        lines.append(f"pool of {human(pool_bytes)}: {blocks:,} blocks = {blocks * bs:,} tokens")
    reservation = context * per_token
    entries = cdiv(context, bs)
    used = chat_tokens * per_token
    chat_blocks = cdiv(chat_tokens, bs)
    lines += [
        f"contiguous reservation of {context:,} tokens (max_model_len): {_token_bytes(context, per_token)}",
        f"block table at {context:,} tokens: ceil({context:,} / {bs}) = {entries:,} entries x 4 bytes = "
        f"{human(entries * 4)}, guarding {human(reservation)}",
        f"a {chat_tokens}-token chat: {_token_bytes(chat_tokens, per_token)}; contiguous waste "
        f"({human(reservation)} - {human(used)}) / {human(reservation)} = {_waste_percent(reservation, used)}",
        f"  paged: {chat_blocks} blocks ({human(chat_blocks * per_block)}, a {chat_blocks}-entry block table), "
        f"waste {chat_blocks * bs - chat_tokens} tokens = {_waste_percent(chat_blocks * bs, chat_tokens)}",
        f"block size trade-off for a {chat_tokens}-token sequence (expected waste (B - 1) / 2 tokens):",
        "  | block size | expected waste (tokens) | of the sequence | block table entries |",
    ]
    for size in block_sizes:
        waste = (size - 1) / 2
        lines.append(f"  | {size} | {waste:g} | {100 * waste / chat_tokens:.1f}% | {cdiv(chat_tokens, size)} |")
    private = n * prompt_tokens * per_token
    shared = prompt_tokens * per_token
    lines.append(
        f"n={n} samples of a {prompt_tokens:,}-token prompt: unshared {n} x {prompt_tokens:,} x {human(per_token)} = "
        f"{human(private)}; shared once ({cdiv(prompt_tokens, bs)} blocks, ref count {n}) = {human(shared)}: "
        f"{private / shared:.1f}x less, {human(private - shared)} saved"
    )
    unshared = sessions * shared_prefix_tokens * per_token
    prefix_blocks = cdiv(shared_prefix_tokens, bs)
    cached = prefix_blocks * per_block
    lines.append(
        f"{sessions} sessions re-sending a {shared_prefix_tokens:,}-token prefix: unshared {sessions} x "
        f"{shared_prefix_tokens:,} x {human(per_token)} = {human(unshared)}; prefix-cached {prefix_blocks} blocks x "
        f"{human(per_block)} = {human(cached)}: {unshared / cached:.0f}x less"
    )
    return lines


def explain_groups(shape: KVShape, layer_windows: list[LayerAttention], context: int) -> list[str]:
    """What the hybrid KV manager keeps of a model whose layers attend differently
    (``core.kv_groups``): its groups, a block's size, and a ``context``-token sequence's
    bytes with it and with every block kept. No lines for a model whose layers all attend alike."""
    hybrid = kv_group_layout(layer_windows)
    if not hybrid.is_hybrid:
        return []
    per_layer_token = shape.bytes_per_token // shape.num_layers
    lines = [f"hybrid KV cache manager: {hybrid.describe(per_layer_token)}",
             f"a block of the hybrid pool holds {hybrid.num_slots} layers: {shape.block_size} x "
             f"{hybrid.num_slots} x {human(per_layer_token)} = {human(shape.block_size * hybrid.num_slots * per_layer_token)}"]
    for tokens in sorted({1024, 4096, context}):
        kept = _held_bytes(hybrid, tokens, shape.block_size, per_layer_token)
        every = _held_bytes(kv_group_layout(layer_windows, hybrid=False), tokens, shape.block_size, per_layer_token)
        lines.append(f"  a {tokens:,}-token sequence holds {human(kept)} (hybrid) vs {human(every)} with every "
                     f"block kept (--disable-hybrid-kv-cache-manager): {kept / every:.2f}x")
    return lines


def _held_bytes(layout: KVGroupLayout, tokens: int, block_size: int, per_layer_token: int) -> int:
    return layout.blocks_held(tokens, block_size) * layout.num_slots * block_size * per_layer_token

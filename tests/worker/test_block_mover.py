"""The block mover over a small pool: the plan's order gives the right bytes, and
swapped blocks and host tier entries share one host store."""

from __future__ import annotations

import torch

from pagedllm.attention.kv_cache import LayerKVCache, allocate_layer
from pagedllm.core.block_moves import (BlockMovePlan, CopyBlock, SwapIn, SwapOut, TailIn, TailOut, TierDrop,
                                       TierLoad, TierOffload, TierPersist)
from pagedllm.kv_tiers.block_codec import BlockCodec
from pagedllm.kv_tiers.host import HostKVStore
from pagedllm.kv_tiers.runner_tiers import RunnerTiers
from pagedllm.worker.block_mover import BlockMover

NUM_BLOCKS, BLOCK_SIZE, NUM_SWAP = 8, 4, 4
CPU = torch.device("cpu")


def pool(kv_cache_dtype: str = "auto", tails: bool = False) -> list[LayerKVCache]:
    torch.manual_seed(0)
    caches = [allocate_layer(NUM_BLOCKS, BLOCK_SIZE, 2, 8, torch.float32, kv_cache_dtype, CPU, tails)
              for _ in range(3)]
    for layer in caches:
        for tensor in (*layer.tensors(), *([layer.tail_key, layer.tail_value] if layer.has_tails else [])):
            tensor.copy_(torch.randint(-100, 100, tensor.shape) if tensor.dtype == torch.int8
                         else torch.rand(tensor.shape))
    return caches


def block(caches: list[LayerKVCache], block_id: int) -> list[torch.Tensor]:
    return [t[block_id].clone() for layer in caches for t in layer.tensors()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class DiskStub:
    def __init__(self) -> None:
        self.written: dict[bytes, torch.Tensor] = {}

    def write_behind(self, key: bytes, payload: torch.Tensor) -> None:
        self.written[key] = payload


def mover_for(caches: list[LayerKVCache], disk: DiskStub | None = None) -> BlockMover:
    mover = BlockMover(caches, HostKVStore(BlockCodec(caches), NUM_SWAP))
    mover.attach_tiers(RunnerTiers(mover.host, disk))
    return mover


def test_a_block_freed_by_a_swap_out_is_reused_in_the_same_step():
    """Blocks 1, 2 and 4 go out to the host and, in the same step, take a copy,
    a swap-in and a tier load: each destination gets its new bytes and each
    host row the old ones, whatever order the moves were added in."""
    caches = pool()
    mover = mover_for(caches)
    old = {b: block(caches, b) for b in range(NUM_BLOCKS)}
    mover.before_forward(BlockMovePlan([SwapOut(5, 2), TierOffload(6, b"k")]))  # an earlier step
    mover.before_forward(BlockMovePlan([TierLoad(b"k", 4), SwapIn(2, 2), CopyBlock(3, 1),
                                        SwapOut(1, 0), SwapOut(2, 1), SwapOut(4, 3)]))
    assert same(block(caches, 1), old[3]) and same(block(caches, 2), old[5]) and same(block(caches, 4), old[6])
    mover.before_forward(BlockMovePlan([SwapIn(0, 0), SwapIn(1, 5), SwapIn(3, 7)]))
    assert same(block(caches, 0), old[1]) and same(block(caches, 5), old[2]) and same(block(caches, 7), old[4])


def test_an_offload_and_a_load_of_one_block_in_one_step():
    """Block 0 is evicted (offloaded as ``a``) and reused for a load of ``b`` in
    the same step; ``b`` is also dropped in that step, after its load."""
    caches = pool()
    mover = mover_for(caches)
    old = {b: block(caches, b) for b in range(NUM_BLOCKS)}
    mover.before_forward(BlockMovePlan([TierOffload(3, b"b")]))
    mover.before_forward(BlockMovePlan([TierDrop(b"b"), TierLoad(b"b", 0), TierOffload(0, b"a")]))
    assert same(block(caches, 0), old[3]) and set(mover.host.entries) == {b"a"}
    mover.before_forward(BlockMovePlan([TierLoad(b"a", 6)]))
    assert same(block(caches, 6), old[0])


def test_persists_run_after_the_forward_and_only_where_tiers_are_attached():
    caches = pool()
    disk = DiskStub()
    mover = mover_for(caches, disk)
    plan = BlockMovePlan([TierPersist(2, b"p"), CopyBlock(2, 3)])
    mover.before_forward(plan)
    assert not disk.written
    mover.after_forward(plan)
    assert list(disk.written) == [b"p"]
    mover.host.put(b"p", disk.written[b"p"])
    mover.before_forward(BlockMovePlan([TierLoad(b"p", 5)]))
    assert same(block(caches, 5), block(caches, 3))
    # A pool without tiers (a draft model's) moves its blocks and skips the tier phases.
    bare = BlockMover(pool(), HostKVStore(BlockCodec(caches), NUM_SWAP))
    bare.before_forward(BlockMovePlan([TierOffload(1, b"x"), CopyBlock(1, 2)]))
    bare.after_forward(BlockMovePlan([TierPersist(1, b"y")]))
    assert not bare.host.entries and same(block(bare.kv_caches, 2), block(bare.kv_caches, 1))


def test_swapped_blocks_and_tier_entries_share_one_host_store():
    """One codec, one store: a swap row and tier entries side by side, each
    counted in its own bytes (swap space reserved whole, the tier per entry)."""
    caches = pool("int8", tails=True)  # tail slots 0 and 1: blocks 0-3 and 4-7
    mover = mover_for(caches)
    host = mover.host
    block_bytes = host.codec.block_bytes
    assert block_bytes == sum(t[0].numel() * t.element_size() for layer in caches for t in layer.tensors())
    assert host.swap_bytes == NUM_SWAP * block_bytes and host.tier_bytes == 0
    old = {b: block(caches, b) for b in range(NUM_BLOCKS)}
    tails = [(layer.tail_key[1].clone(), layer.tail_value[1].clone()) for layer in caches]
    mover.before_forward(BlockMovePlan([SwapOut(2, 3), TierOffload(2, b"t"), TierOffload(4, b"u"), TailOut(1, 3)]))
    assert host.tier_bytes == 2 * block_bytes and host.swap_bytes == NUM_SWAP * block_bytes
    assert set(host.tails) == {3}
    mover.before_forward(BlockMovePlan([TierDrop(b"u"), SwapIn(3, 6), TierLoad(b"t", 7), TailIn(3, 0)]))
    assert same(block(caches, 6), old[2]) and same(block(caches, 7), old[2])
    assert host.tier_bytes == block_bytes and not host.tails
    assert all(torch.equal(layer.tail_key[0], k) and torch.equal(layer.tail_value[0], v)
               for layer, (k, v) in zip(caches, tails))

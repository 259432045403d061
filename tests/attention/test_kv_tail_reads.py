"""Full-precision tails of int8 pools: every reader follows the reading rule.

A query at position p reads key j <= p at full precision iff j and p share a
block and p is not that block's last position; every other key as the int8
pool stores it (``pagedllm.attention.kv_cache``). Each reader is checked
against a brute-force reference of that rule, and against the int8-only
result, which it must not match (so a reader that ignored the tail fails).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.attention.kv_cache import LayerKVCache, allocate_layer, tail_run_blocks
from pagedllm.attention.selector import cpu_decode
from pagedllm.attention.torch_paged import TorchPagedAttention, _LayerOptions
from pagedllm.kernels.cpu import load_cpu_kernels
from tests.attention.test_torch_paged import random_tables, slots_of
from tests.poisoned_pool import poison_layer

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 64, 4
SCALE = HEAD_DIM**-0.5
CPU = torch.device("cpu")
RUN = tail_run_blocks(torch.float32)  # int8 blocks one fp32 tail slot takes


def int8_pool(num_blocks: int, num_tail_slots: int, tails: bool = True) -> tuple[LayerKVCache, int]:
    """An int8 pool with ``num_blocks`` blocks for tables and, past them,
    ``num_tail_slots`` tail slots (a slot is ``RUN`` blocks' bytes: ``allocate_layer``),
    and the first of those slots."""
    first_slot = -(-num_blocks // RUN)
    return allocate_layer((first_slot + num_tail_slots) * RUN, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32,
                          "int8", CPU, tails=tails), first_slot


def reference(query: torch.Tensor, p: int, full_k, full_v, int8_k, int8_v, window: int | None) -> torch.Tensor:
    """[heads, dim] output of the query at position p under the reading rule;
    the K/V arguments are [positions, kv_heads, dim] in the model's basis."""
    first = 0 if window is None else max(0, p - window + 1)
    reads_full = p % BLOCK_SIZE != BLOCK_SIZE - 1
    rows = []
    for j in range(first, p + 1):
        full = reads_full and j // BLOCK_SIZE == p // BLOCK_SIZE
        rows.append(((full_k if full else int8_k)[j], (full_v if full else int8_v)[j]))
    k = torch.stack([r[0] for r in rows]).transpose(0, 1)[None]
    v = torch.stack([r[1] for r in rows]).transpose(0, 1)[None]
    return F.scaled_dot_product_attention(query.view(1, NUM_HEADS, 1, HEAD_DIM), k, v, scale=SCALE,
                                          enable_gqa=True).view(NUM_HEADS, HEAD_DIM)


def stored_int8(pool, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first n K/V as the int8 pool holds them, in the model's basis."""
    k, v = pool.gather(torch.tensor([table]), torch.float32)
    return k[0].transpose(0, 1)[:n], v[0].transpose(0, 1)[:n]


@pytest.mark.parametrize("path", ["pytorch", "cpp"])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_reads_the_last_block_from_its_tail(path, window):
    if path == "cpp" and load_cpu_kernels() is None:
        pytest.fail("the C++ decode kernel did not build on this machine")
    torch.manual_seed(0)
    # Lengths at and around block boundaries: 4, 8 and 12 end a block (no tail read).
    lens = [1, 3, 4, 5, 8, 11, 12, 37]
    tables, num_blocks = random_tables(lens, BLOCK_SIZE, random.Random(1))
    pool, first_slot = int8_pool(num_blocks, len(lens) + 2)
    poison_layer(pool)  # slots and tail positions never written must not be read, even masked
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lens]
    tail_slots = []
    for i, (table, n, k, v) in enumerate(zip(tables, lens, keys, values)):
        # Tail slots deliberately not the row order (slot i + 2), the last block's tokens into it.
        last = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        rows = torch.arange(last, n)
        slot = first_slot + i + 2
        pool.write(k, v, torch.tensor(slots_of(table, range(n), BLOCK_SIZE)), tail_rows=rows,
                   tail_slots=slot * BLOCK_SIZE + rows - last)
        tail_slots.append(slot if n % BLOCK_SIZE else -1)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lens), prefills=[],
    )
    query = torch.randn(len(lens), NUM_HEADS, HEAD_DIM)
    layer = _LayerOptions(SCALE, window, None)
    attention = TorchPagedAttention(cpu_decode if path == "cpp" else None)
    got = attention._decode(query, pool, metadata, layer, torch.tensor(tail_slots))
    int8_only = attention._decode(query, pool, metadata, layer)
    for i, (table, n) in enumerate(zip(tables, lens)):
        int8_k, int8_v = stored_int8(pool, table, n)
        expected = reference(query[i], n - 1, keys[i], values[i], int8_k, int8_v, window)
        torch.testing.assert_close(got[i], expected, atol=1e-4, rtol=1e-4)
        if n % BLOCK_SIZE:
            error, int8_error = (got[i] - expected).abs().max(), (int8_only[i] - expected).abs().max()
            assert int8_error > 10 * error, f"row {i} ignored its tail"
        else:
            torch.testing.assert_close(got[i], int8_only[i], atol=1e-5, rtol=1e-5)


def test_a_tail_slot_out_of_range_is_refused():
    if load_cpu_kernels() is None:
        pytest.fail("the C++ decode kernel did not build on this machine")
    pool, first_slot = int8_pool(2, 1)
    with pytest.raises(RuntimeError, match="tail slot out of range"):
        cpu_decode(torch.zeros(1, NUM_HEADS, HEAD_DIM), pool, torch.zeros(1, 1, dtype=torch.long),
                   torch.tensor([2]), SCALE, tail_slots=torch.tensor([first_slot + 1]))


def test_tails_are_for_int8_pools():
    with pytest.raises(ValueError, match="int8"):
        allocate_layer(2 * RUN, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "fp8_e4m3", CPU, tails=True)


def _prefill_step(attention, pool, query, k, v, table, start, end, slot_of_block, soft_cap=None, window=None):
    """Run positions [start, end) of one sequence as one prefill span whose
    tokens all also go to their block's tail slot (the runner writes fewer:
    the rule reads only same-block earlier tokens)."""
    positions = range(start, end)
    tail_rows = torch.arange(end - start)
    tail_slots = torch.tensor([slot_of_block[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])
    span = PrefillSpan(0, end - start, end, torch.tensor(table),
                       tail_slot=slot_of_block[start // BLOCK_SIZE] if start % BLOCK_SIZE else -1)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots_of(table, positions, BLOCK_SIZE)), num_decodes=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long), decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefills=[span], tail_write_rows=tail_rows, tail_write_slots=tail_slots,
        decode_tail_slots=torch.zeros(0, dtype=torch.long),
    )
    return attention.forward(query[start:end], k[start:end], v[start:end], pool, metadata, SCALE,
                             sliding_window=window, logits_soft_cap=soft_cap)


def _scattered(n: int) -> tuple[list[int], dict[int, int]]:
    """A table for n tokens of scattered blocks (2 spare), and a tail slot per table
    index, past the table's blocks (``int8_pool``)."""
    num_blocks = -(-n // BLOCK_SIZE)
    rng = random.Random(n)
    table = rng.sample(range(num_blocks + 2), num_blocks)
    first_slot = -(-(num_blocks + 2) // RUN)
    slots = rng.sample(range(first_slot, first_slot + num_blocks), num_blocks)
    return table, dict(enumerate(slots))


@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("chunks", [[13], [2, 11], [5, 3, 5], [4, 9], [300], [130, 170], [3, 297]])
def test_prefill_follows_the_rule_whatever_the_chunking(chunks, window, soft_cap):
    """Spans of up to 300 queries cover several of the prefill's query runs
    (``_TAIL_QUERY_CHUNK``), starting and ending mid-block."""
    torch.manual_seed(4)
    n = sum(chunks)
    table, slot_of_block = _scattered(n)
    query = torch.randn(n, NUM_HEADS, HEAD_DIM)
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)

    def pool(tails: bool):
        layer, _ = int8_pool(len(table) + 2, len(table), tails)
        poison_layer(layer)  # slots and tail positions never written must not be read
        return layer

    chunked = pool(True)
    attention = TorchPagedAttention()
    outputs, start = [], 0
    for size in chunks:
        outputs.append(_prefill_step(attention, chunked, query, k, v, table, start, start + size, slot_of_block,
                                     soft_cap, window))
        start += size
    got = torch.cat(outputs)
    int8_k, int8_v = stored_int8(chunked, table, n)
    if soft_cap is None:
        for p in range(n):
            expected = reference(query[p], p, k, v, int8_k, int8_v, window)
            torch.testing.assert_close(got[p], expected, atol=1e-4, rtol=1e-4)
    # Whatever the chunking, the same bits up to summation order.
    once = _prefill_step(attention, pool(True), query, k, v, table, 0, n, slot_of_block, soft_cap, window)
    torch.testing.assert_close(got, once, atol=1e-5, rtol=1e-5)
    # Positions that read a full-precision key differ from int8-only reading, the others not.
    int8_only = _prefill_step(attention, pool(False), query, k, v, table, 0, n, slot_of_block, soft_cap, window)
    for p in range(n):
        differs = (got[p] - int8_only[p]).abs().max() > 1e-5
        assert differs == (p % BLOCK_SIZE != BLOCK_SIZE - 1), p


@pytest.mark.parametrize("path", ["pytorch", "cpp"])
def test_decode_after_prefill_matches_prefill_of_the_same_position(path):
    """A token decoded after a prefill reads what a prefill of it would: the
    same rule on both paths (here for every position of a 13-token sequence)."""
    torch.manual_seed(5)
    n = 13
    table = [5, 0, 3, 1]
    first = -(-6 // RUN)  # the tail slots past the 6 blocks (``int8_pool``)
    slot_of_block = {0: first + 2, 1: first, 2: first + 3, 3: first + 1}
    query = torch.randn(n, NUM_HEADS, HEAD_DIM)
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)
    pool, _ = int8_pool(6, 4)
    poison_layer(pool)
    prefilled = _prefill_step(TorchPagedAttention(), pool, query, k, v, table, 0, n, slot_of_block)
    attention = TorchPagedAttention(cpu_decode if path == "cpp" else None)
    lens = torch.arange(1, n + 1)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=n,
        decode_block_tables=torch.tensor([table] * n), decode_context_lens=lens, prefills=[],
    )
    tail_slots = torch.tensor([slot_of_block[p // BLOCK_SIZE] if p % BLOCK_SIZE != BLOCK_SIZE - 1 else -1
                               for p in range(n)])
    decoded = attention._decode(query, pool, metadata, _LayerOptions(SCALE, None, None), tail_slots)
    torch.testing.assert_close(decoded, prefilled, atol=1e-4, rtol=1e-4)

"""Paged attention must equal plain contiguous causal attention."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.selector import cpu_decode, triton_decode
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.kernels import triton_paged
from pagedllm.kernels.cpu import load_cpu_kernels

KERNEL = load_cpu_kernels()
# Without a GPU the Triton kernel runs on CPU tensors through Triton's
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any import).
BACKENDS = {
    "pytorch": TorchPagedAttention(),
    "cpp": TorchPagedAttention(cpu_decode, decode_reads_sinks=True),
    "triton": TorchPagedAttention(triton_decode),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    if request.param == "cpp" and KERNEL is None:
        pytest.fail("the C++ decode kernel did not build on this machine")
    if request.param == "triton" and not triton_paged.triton_paged_decode_available():
        pytest.fail("Triton is not installed (it is a test dependency)")
    return BACKENDS[request.param]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5


def reference(q, k, v):
    """Contiguous causal attention of one whole sequence: q [L, H, D], k/v [L, Hkv, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=SCALE, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def random_tables(lengths, block_size, rng):
    """Scatter each sequence over random, disjoint physical blocks."""
    needed = [math.ceil(n / block_size) for n in lengths]
    physical = list(range(sum(needed) + 3))
    rng.shuffle(physical)
    tables, at = [], 0
    for n in needed:
        tables.append(physical[at : at + n])
        at += n
    return tables, len(physical)


def slots_of(table, positions, block_size):
    return [table[p // block_size] * block_size + p % block_size for p in positions]

def prefill_step(backend, cache, tables, seqs, parts, block_size, scale, **options):
    """One step of prefill spans through ``backend``; parts: (sequence, first, end) runs of
    prompt tokens, taken from seqs[sequence] = (q, k, v)."""
    spans, slots, start = [], [], 0
    for i, first, end in parts:
        spans.append(PrefillSpan(start, end - first, end, torch.tensor(tables[i])))
        slots += slots_of(tables[i], range(first, end), block_size)
        start += end - first
    q, k, v = (torch.cat([seqs[i][j][a:b] for i, a, b in parts]) for j in range(3))
    meta = AttentionMetadata(torch.tensor(slots), 0, torch.zeros(0, 0, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), spans)
    return backend.forward(q, k, v, cache, meta, scale, **options)


def decode_only_metadata(tables, lens):
    """A step of decodes only: each sequence's table padded to the widest, nothing to write."""
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lens), prefills=[],
    )

def sdpa_reference(query, key_cache, value_cache, table, length, scale):
    """fp32 SDPA of one decode query ([heads, head_dim]) over the ``length``
    tokens its block table points at in the pool: what a paged decode must give."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = torch.tensor(slots_of(table, range(length), block_size))
    k = key_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    v = value_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    num_heads = query.shape[0]
    return F.scaled_dot_product_attention(
        query.float().view(1, num_heads, 1, head_dim), k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        scale=scale, enable_gqa=True,
    ).view(num_heads, head_dim)




@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prefill_then_decode_equals_contiguous(block_size, backend):
    """Prefill ragged prompts in one batch, then decode one token each through the block tables."""
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    prompt_lens = [1, 5, 17, 64, 100]
    total_lens = [n + 1 for n in prompt_lens]
    tables, num_blocks = random_tables(total_lens, block_size, rng)
    # NaN where nothing is written: the pool is uninitialised, and no read may touch those slots.
    key_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    seqs = [
        (torch.randn(n, NUM_HEADS, HEAD_DIM), torch.randn(n, NUM_KV_HEADS, HEAD_DIM), torch.randn(n, NUM_KV_HEADS, HEAD_DIM))
        for n in total_lens
    ]

    # Step 1: all prompts as prefill spans (the 1-token prompt too, to cover that shape).
    q = torch.cat([s[0][:n] for s, n in zip(seqs, prompt_lens)])
    k = torch.cat([s[1][:n] for s, n in zip(seqs, prompt_lens)])
    v = torch.cat([s[2][:n] for s, n in zip(seqs, prompt_lens)])
    spans, slots, start = [], [], 0
    for table, n in zip(tables, prompt_lens):
        spans.append(PrefillSpan(start, n, n, torch.tensor(table)))
        slots += slots_of(table, range(n), block_size)
        start += n
    meta = AttentionMetadata(torch.tensor(slots), 0, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long), spans)
    out = backend.forward(q, k, v, LayerKVCache(key_cache, value_cache), meta, SCALE)
    start = 0
    for (sq, sk, sv), n in zip(seqs, prompt_lens):
        torch.testing.assert_close(out[start : start + n], reference(sq[:n], sk[:n], sv[:n]), atol=1e-5, rtol=1e-5)
        start += n

    # Step 2: one decode token per sequence, batched, reading K/V through the tables.
    q = torch.stack([s[0][n] for s, n in zip(seqs, prompt_lens)])
    k = torch.stack([s[1][n] for s, n in zip(seqs, prompt_lens)])
    v = torch.stack([s[2][n] for s, n in zip(seqs, prompt_lens)])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slots_of(t, [n], block_size)[0] for t, n in zip(tables, prompt_lens)]),
        num_decodes=len(seqs),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(total_lens),
        prefills=[],
    )
    out = backend.forward(q, k, v, LayerKVCache(key_cache, value_cache), meta, SCALE)
    for i, (sq, sk, sv) in enumerate(seqs):
        torch.testing.assert_close(out[i], reference(sq, sk, sv)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_chunked_prefill_reads_earlier_context_from_pool(block_size, backend):
    """A second prefill chunk attends to the first chunk's K/V via the block table,
    mixed in one step with a decode of another sequence."""
    rng = random.Random(7 + block_size)
    torch.manual_seed(7)
    lens = [90, 33]
    tables, num_blocks = random_tables(lens, block_size, rng)
    # NaN where nothing is written: the pool is uninitialised, and no read may touch those slots.
    key_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    seqs = [(torch.randn(n, NUM_HEADS, HEAD_DIM), torch.randn(n, NUM_KV_HEADS, HEAD_DIM), torch.randn(n, NUM_KV_HEADS, HEAD_DIM)) for n in lens]
    chunk = 50
    # Step 1: first chunk of seq 0 and all but the last token of seq 1.
    parts = [(0, 0, chunk), (1, 0, lens[1] - 1)]
    q = torch.cat([seqs[i][0][a:b] for i, a, b in parts])
    k = torch.cat([seqs[i][1][a:b] for i, a, b in parts])
    v = torch.cat([seqs[i][2][a:b] for i, a, b in parts])
    spans, slots, start = [], [], 0
    for i, a, b in parts:
        spans.append(PrefillSpan(start, b - a, b, torch.tensor(tables[i])))
        slots += slots_of(tables[i], range(a, b), block_size)
        start += b - a
    meta = AttentionMetadata(torch.tensor(slots), 0, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long), spans)
    backend.forward(q, k, v, LayerKVCache(key_cache, value_cache), meta, SCALE)
    # Step 2: seq 1 decodes its last token (first in the batch), seq 0 prefills the rest.
    q = torch.cat([seqs[1][0][-1:], seqs[0][0][chunk:]])
    k = torch.cat([seqs[1][1][-1:], seqs[0][1][chunk:]])
    v = torch.cat([seqs[1][2][-1:], seqs[0][2][chunk:]])
    slots = slots_of(tables[1], [lens[1] - 1], block_size) + slots_of(tables[0], range(chunk, lens[0]), block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=1,
        decode_block_tables=torch.tensor([tables[1]]),
        decode_context_lens=torch.tensor([lens[1]]),
        prefills=[PrefillSpan(1, lens[0] - chunk, lens[0], torch.tensor(tables[0]))],
    )
    out = backend.forward(q, k, v, LayerKVCache(key_cache, value_cache), meta, SCALE)
    torch.testing.assert_close(out[0], reference(*seqs[1])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], reference(*seqs[0])[chunk:], atol=1e-5, rtol=1e-5)
    # The pool holds exactly the sequences' K at their slots.
    for i, n in enumerate(lens):
        got = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[torch.tensor(slots_of(tables[i], range(n), block_size))]
        torch.testing.assert_close(got, seqs[i][1])


def test_cpp_decode_kernel_handles_bfloat16(backend):
    """bf16 storage, fp32 accumulation: close to fp32 attention on the same values."""
    torch.manual_seed(3)
    block_size, lens = 16, [1, 33, 200]
    tables, num_blocks = random_tables(lens, block_size, random.Random(3))
    key_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM).bfloat16()
    value_cache = torch.randn_like(key_cache)
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM).bfloat16()
    meta = decode_only_metadata(tables, lens)
    out = backend.forward(q, torch.zeros(0, NUM_KV_HEADS, HEAD_DIM).bfloat16(),
                          torch.zeros(0, NUM_KV_HEADS, HEAD_DIM).bfloat16(), LayerKVCache(key_cache, value_cache),
                          meta, SCALE)
    for i, (table, n) in enumerate(zip(tables, lens)):
        expected = sdpa_reference(q[i], key_cache, value_cache, table, n, SCALE)
        torch.testing.assert_close(out[i].float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("lens", [[700], [1, 700], [5, 17, 64, 300], [40] * 9])
def test_decode_kernel_splits_and_head_sizes_match_sdpa(backend, head_dim, lens):
    """Short batches split each context into partitions that are merged after;
    long batches take one task per sequence; head sizes 64 and 128 have their
    own compiled paths. All must equal SDPA over the sequence's own K/V,
    including partitions left empty by a short sequence. The query is a
    row-strided view, as the q part of the model's fused qkv output is."""
    torch.manual_seed(len(lens) + head_dim)
    block_size = 16
    tables, num_blocks = random_tables(lens, block_size, random.Random(head_dim))
    key_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim)
    value_cache = torch.randn_like(key_cache)
    qkv = torch.randn(len(lens), (NUM_HEADS + 2 * NUM_KV_HEADS) * head_dim)
    q = qkv[:, : NUM_HEADS * head_dim].view(len(lens), NUM_HEADS, head_dim)
    meta = decode_only_metadata(tables, lens)
    empty = torch.zeros(0, NUM_KV_HEADS, head_dim)
    out = backend.forward(q, empty, empty, LayerKVCache(key_cache, value_cache), meta, head_dim**-0.5)
    for i, (table, n) in enumerate(zip(tables, lens)):
        expected = sdpa_reference(q[i], key_cache, value_cache, table, n, head_dim**-0.5)
        torch.testing.assert_close(out[i], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (12, 3), (8, 2), (10, 2)])
def test_decode_kernel_query_groups_match_sdpa(backend, dtype, num_heads, num_kv_heads):
    """1, 2, 3 and 4 query heads per KV head take the C++ kernel's grouped
    path (each K/V token read once for the whole group; head_dim 64, 16-token
    blocks), 5 the general one; every group size must equal SDPA, on full and
    partial blocks."""
    torch.manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, block_size, lens = 64, 16, [1, 16, 33, 250]
    tables, num_blocks = random_tables(lens, block_size, random.Random(num_heads))
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn_like(key_cache)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    meta = decode_only_metadata(tables, lens)
    empty = torch.zeros(0, num_kv_heads, head_dim, dtype=dtype)
    out = backend.forward(q, empty, empty, LayerKVCache(key_cache, value_cache), meta, head_dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (table, n) in enumerate(zip(tables, lens)):
        expected = sdpa_reference(q[i], key_cache, value_cache, table, n, head_dim**-0.5)
        torch.testing.assert_close(out[i].float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_puts_each_token_in_its_slot_from_strided_rows(dtype):
    # K and V as the model hands them over: row-strided slices of one fused qkv output.
    qkv = torch.randn(7, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    k = qkv[:, NUM_HEADS * HEAD_DIM:(NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(7, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM:].view(7, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([5, 0, 63, 17, 16, 40, 2])
    pool = LayerKVCache(torch.zeros(4, 16, NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
                        torch.zeros(4, 16, NUM_KV_HEADS, HEAD_DIM, dtype=dtype))
    pool.write(k, v, slots)
    expected_k = torch.zeros(64, NUM_KV_HEADS, HEAD_DIM, dtype=dtype).index_copy_(0, slots, k)
    expected_v = torch.zeros(64, NUM_KV_HEADS, HEAD_DIM, dtype=dtype).index_copy_(0, slots, v)
    assert torch.equal(pool.key.view(64, NUM_KV_HEADS, HEAD_DIM), expected_k)
    assert torch.equal(pool.value.view(64, NUM_KV_HEADS, HEAD_DIM), expected_v)


def test_cache_write_kernel_refuses_a_slot_outside_the_pool():
    if KERNEL is None:
        pytest.fail("the C++ kernels did not build on this machine")
    rows = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    pool = torch.zeros(2, 16, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="slot 32 is outside the pool's 32 slots"):
        KERNEL.write_kv_cache(rows, rows, pool, pool.clone(), torch.tensor([3, 32]))
    with pytest.raises(RuntimeError, match="one dtype"):
        KERNEL.write_kv_cache(rows.double(), rows.double(), pool, pool.clone(), torch.tensor([3, 4]))

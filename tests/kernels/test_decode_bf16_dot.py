"""The bf16 decode-attention path on VDPBF16PS (paged_decode_grouped.h,
``attend_block_dpbf16``): bf16 K and V are read without widening K to fp32,
all KV heads of a block at once. Checked against an fp32 torch reference on
the same bf16 values, against the widening path (``PAGEDLLM_DECODE_BF16_DOT=0``),
and on a NaN-filled pool (slots past a sequence's end are never read into a
sum). On a CPU without AVX-512 BF16 both settings run the widening path and
the tests still hold."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels

BLOCK = 16
HEAD_DIM = 64


def kernels():
    module = load_cpu_kernels()
    if module is None:
        pytest.skip("C++ CPU kernels unavailable")
    return module


def paged_case(lens: list[int], num_heads: int, num_kv_heads: int, seed: int, poison: bool = False):
    """bf16 query and pool with each sequence's blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks = [math.ceil(n / BLOCK) for n in lens]
    num_blocks = sum(blocks) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int64)
    used = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[used:used + count])
        used += count
    key = torch.randn(num_blocks, BLOCK, num_kv_heads, HEAD_DIM, generator=gen).bfloat16()
    value = torch.randn(num_blocks, BLOCK, num_kv_heads, HEAD_DIM, generator=gen).bfloat16()
    if poison:
        # Every slot no sequence wrote (past each context's end, and unused blocks) is NaN.
        written = torch.zeros(num_blocks, BLOCK, dtype=torch.bool)
        for i, n in enumerate(lens):
            for pos in range(n):
                written[tables[i, pos // BLOCK], pos % BLOCK] = True
        key[~written] = float("nan")
        value[~written] = float("nan")
    query = torch.randn(len(lens), num_heads, HEAD_DIM, generator=gen).bfloat16()
    return query, key, value, tables, torch.tensor(lens, dtype=torch.int64)


def reference(query, key, value, tables, lens, scale):
    """fp32 attention over each sequence's own bf16 K/V (the values the kernel reads)."""
    num_heads, num_kv_heads = query.shape[1], key.shape[2]
    outs = []
    for i, n in enumerate(lens.tolist()):
        slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        k = key.view(-1, num_kv_heads, HEAD_DIM)[slots].float().repeat_interleave(num_heads // num_kv_heads, 1)
        v = value.view(-1, num_kv_heads, HEAD_DIM)[slots].float().repeat_interleave(num_heads // num_kv_heads, 1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", query[i].float(), k) * scale, dim=-1)
        outs.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(outs)


def decode(query, key, value, tables, lens, scale, monkeypatch, dot: str):
    monkeypatch.setenv("PAGEDLLM_DECODE_BF16_DOT", dot)
    return kernels().paged_decode_attention(query, key, value, None, None, tables, lens, scale, 0, 0.0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (4, 2), (9, 3), (8, 2), (5, 1)])
@pytest.mark.parametrize("lens", [[1, 15, 16, 17], [33, 250], [7] * 5])
def test_bf16_dot_path_matches_fp32_reference(num_heads, num_kv_heads, lens, monkeypatch):
    """Group sizes 1-4 take the VDPBF16PS path, 5 the general one; full, partial and
    odd-length last blocks; fewer sequences than threads split into partitions."""
    query, key, value, tables, context = paged_case(lens, num_heads, num_kv_heads, seed=num_heads + len(lens))
    scale = HEAD_DIM**-0.5
    out = decode(query, key, value, tables, context, scale, monkeypatch, "1")
    expected = reference(query, key, value, tables, context, scale)
    # The output is stored in bf16: within its rounding (2^-8 relative) of the fp32 result.
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    # As close to fp32 as the widening path (it rounds the same fp32 result to bf16).
    widened = decode(query, key, value, tables, context, scale, monkeypatch, "0")
    ours, theirs = (out.float() - expected).abs().max(), (widened.float() - expected).abs().max()
    assert ours <= theirs * 1.5 + 1e-3, (ours, theirs)


def test_bf16_dot_path_never_reads_unwritten_slots(monkeypatch):
    """NaN in every slot no sequence wrote: no output row may turn NaN (the odd last
    token of a block, the rest of its block and the unused blocks included)."""
    query, key, value, tables, context = paged_case([1, 5, 16, 31, 40], 9, 3, seed=7, poison=True)
    out = decode(query, key, value, tables, context, 0.125, monkeypatch, "1")
    assert not out.isnan().any()
    clean = key.nan_to_num(0.0), value.nan_to_num(0.0)
    torch.testing.assert_close(out.float(), reference(query, *clean, tables, context, 0.125), atol=1e-2, rtol=1e-2)


def test_bf16_dot_path_large_scores_stay_finite(monkeypatch):
    """Scores far apart across blocks (the online softmax rescales the running sums)."""
    query, key, value, tables, context = paged_case([64, 200], 6, 2, seed=11)
    key[:, 3] *= 20  # one token per block dominates
    scale = HEAD_DIM**-0.5
    out = decode(query, key, value, tables, context, scale, monkeypatch, "1")
    torch.testing.assert_close(out.float(), reference(query, key, value, tables, context, scale), atol=2e-2,
                               rtol=2e-2)

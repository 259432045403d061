"""The C++ bf16 prefill attention kernel against fp32 attention on the same bf16 values."""

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import selector
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.selector import attention_backend_for, cpu_decode, cpu_prefill, prefill_kernel_for
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.kernels.cpu import load_cpu_kernels
from tests.attention.test_torch_paged import prefill_step, random_tables


@pytest.fixture(autouse=True)
def kernels():
    if load_cpu_kernels() is None:
        pytest.fail("the C++ CPU kernels did not build on this machine")


def visible(num_queries: int, num_keys: int, query_offset: int) -> torch.Tensor:
    return torch.arange(num_keys)[None, :] <= (torch.arange(num_queries) + query_offset)[:, None]


def sdpa(q, k, v, scale, query_offset, dtype=torch.float32):
    """PyTorch's SDPA in ``dtype`` on [n, heads, dim] tensors, query i seeing keys <= i + offset."""
    heads_first = [t.to(dtype).transpose(0, 1)[None] for t in (q, k, v)]
    mask = visible(q.shape[0], k.shape[0], query_offset)
    return F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


# (queries, keys, heads, kv heads, head dim): partial tiles of 8 query rows and 32 keys,
# earlier context (keys > queries), GQA groups of 1, 3 and 4.
SHAPES = [(1, 1, 9, 3, 64), (7, 7, 9, 3, 64), (31, 31, 4, 4, 16), (32, 32, 9, 3, 64), (33, 33, 8, 8, 128),
          (100, 137, 9, 3, 64), (1, 300, 8, 2, 128), (200, 200, 9, 3, 64), (65, 96, 4, 1, 32)]


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_kernel_is_at_least_as_close_to_fp32_as_pytorch_bf16(shape):
    num_queries, num_keys, heads, kv_heads, dim = shape
    torch.manual_seed(sum(shape))
    q = torch.randn(num_queries, heads, dim).bfloat16()
    k, v = torch.randn(num_keys, kv_heads, dim).bfloat16(), torch.randn(num_keys, kv_heads, dim).bfloat16()
    scale, offset = dim**-0.5, num_keys - num_queries
    out = cpu_prefill(q, k, v, scale, offset)
    assert out.dtype == torch.bfloat16 and out.shape == (num_queries, heads, dim)
    exact = sdpa(q, k, v, scale, offset)
    ours, theirs = (out.float() - exact).abs(), (sdpa(q, k, v, scale, offset, torch.bfloat16).float() - exact).abs()
    # Within one bf16 rounding of the output, and on average closer than PyTorch's bf16 SDPA:
    # P stays fp32 for P . V here (0.68-0.82x PyTorch's mean error on these shapes; rounding P
    # to bf16 as PyTorch does gives 1.0x). One key: both return that key's value exactly.
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)
    assert ours.mean() <= theirs.mean() * 0.9 + 1e-6


def test_strided_rows_read_as_packed_ones():
    """The backend hands the kernel views into the fused qkv projection."""
    torch.manual_seed(5)
    heads, kv_heads, dim, n = 9, 3, 64, 45
    fused = torch.randn(n, (heads + 2 * kv_heads) * dim).bfloat16()
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
    assert q.stride(0) == fused.shape[1]
    packed = cpu_prefill(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, 0)
    assert torch.equal(cpu_prefill(q, k, v, 0.125, 0), packed)


def test_other_dtypes_take_pytorch_sdpa():
    torch.manual_seed(6)
    q, k, v = torch.randn(20, 6, 16), torch.randn(29, 2, 16), torch.randn(29, 2, 16)
    torch.testing.assert_close(cpu_prefill(q, k, v, 0.25, 9), sdpa(q, k, v, 0.25, 9), atol=1e-6, rtol=1e-6)


def test_queries_must_see_existing_keys():
    q, k = torch.zeros(5, 2, 16).bfloat16(), torch.zeros(6, 2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="keys up to i \\+ query_offset"):
        cpu_prefill(q, k, k, 0.25, 2)


def test_selector_picks_the_kernel_for_bf16_on_cpu_only(monkeypatch):
    monkeypatch.setattr(selector, "cpu_has_amx", lambda: False)
    cpu = torch.device("cpu")
    assert prefill_kernel_for(cpu, torch.bfloat16) is cpu_prefill
    assert prefill_kernel_for(cpu, torch.float32) is None and prefill_kernel_for(cpu, None) is None
    assert prefill_kernel_for(torch.device("cuda"), torch.bfloat16) is None
    assert attention_backend_for(cpu, 16, dtype=torch.bfloat16).prefill_kernel is cpu_prefill
    assert attention_backend_for(cpu, 16).prefill_kernel is None


def test_an_amx_cpu_keeps_sdpa_for_bf16_prefill(monkeypatch):
    # PyTorch's bf16 SDPA runs on AMX tiles there, 2x the C++ kernel from 128 tokens up.
    monkeypatch.setattr(selector, "cpu_has_amx", lambda: True)
    assert prefill_kernel_for(torch.device("cpu"), torch.bfloat16) is None
    assert attention_backend_for(torch.device("cpu"), 16, dtype=torch.bfloat16).prefill_kernel is None


@pytest.mark.parametrize("block_size", [1, 16])
def test_backend_prefill_chunks_with_the_kernel(block_size):
    """A prompt prefilled in two chunks (the second reads the first from the pool) next to a
    fresh one, through the backend with the kernel: close to fp32 attention on the same values,
    and to the backend's SDPA path."""
    torch.manual_seed(block_size)
    heads, kv_heads, dim, lens, chunk = 6, 2, 64, [90, 40], 50
    tables, num_blocks = random_tables(lens, block_size, random.Random(block_size))
    pool = LayerKVCache(torch.full((num_blocks, block_size, kv_heads, dim), float("nan")).bfloat16(),
                        torch.full((num_blocks, block_size, kv_heads, dim), float("nan")).bfloat16())
    seqs = [(torch.randn(n, heads, dim).bfloat16(), torch.randn(n, kv_heads, dim).bfloat16(),
             torch.randn(n, kv_heads, dim).bfloat16()) for n in lens]
    with_kernel, with_sdpa = TorchPagedAttention(cpu_decode, cpu_prefill), TorchPagedAttention(cpu_decode)
    assert with_kernel.prefill_kernel is cpu_prefill and with_sdpa.prefill_kernel is None

    def step(backend, parts):  # parts: (sequence, first, end) prefill spans
        return prefill_step(backend, pool, tables, seqs, parts, block_size, dim**-0.5)

    step(with_kernel, [(0, 0, chunk)])
    parts = [(0, chunk, lens[0]), (1, 0, lens[1])]
    ours, theirs = step(with_kernel, parts), step(with_sdpa, parts)
    start = 0
    for i, first, end in parts:
        q, k, v = seqs[i]
        exact = sdpa(q[first:end], k[:end], v[:end], dim**-0.5, first)
        rows = slice(start, start + end - first)
        torch.testing.assert_close(ours[rows].float(), exact, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ours[rows].float(), theirs[rows].float(), atol=2e-2, rtol=2e-2)
        start += end - first

"""Quantized KV pools: what is stored, the append rule, and attention error against fp32 KV."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.kv_cache import allocate_layer, dequantize, hadamard_rotate, quantize
from pagedllm.attention.selector import cpu_decode, triton_decode
from pagedllm.attention.torch_paged import TorchPagedAttention, _LayerOptions
from pagedllm.kernels.cpu import load_cpu_kernels
from tests.attention.test_torch_paged import random_tables, slots_of
from tests.poisoned_pool import poison_layer

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 64, 16
# (decode path, kv_cache_dtype): the kernels take int8 pools; fp8 goes through PyTorch.
COMBINATIONS = [("pytorch", "int8"), ("pytorch", "fp8_e4m3"), ("cpp", "int8"), ("triton", "int8")]
DECODE_KERNELS = {"pytorch": None, "cpp": cpu_decode, "triton": triton_decode}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_round_trip_error_is_bounded_per_vector(kv_cache_dtype):
    torch.manual_seed(0)
    x = torch.randn(50, NUM_KV_HEADS, HEAD_DIM) * torch.logspace(-3, 2, 50)[:, None, None]
    stored, scale = quantize(x, kv_cache_dtype)
    assert scale.shape == (50, NUM_KV_HEADS) and scale.dtype == torch.float32
    back = dequantize(stored, scale, kv_cache_dtype, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if kv_cache_dtype == "int8":
        # Round to nearest: off by at most half a step, the step being amax / 127.
        assert ((back - x).abs() <= amax / 127 / 2 * 1.0001).all()
    else:
        # e4m3 keeps 3 mantissa bits: within 1/16 relative, or half the smallest subnormal step.
        tolerance = torch.maximum(x.abs() / 16, amax / 448 * 2.0**-10)
        assert ((back - x).abs() <= tolerance * 1.0001).all()
    zeros, zero_scale = quantize(torch.zeros(3, NUM_KV_HEADS, HEAD_DIM), kv_cache_dtype)
    assert (zero_scale > 0).all() and (dequantize(zeros, zero_scale, kv_cache_dtype, torch.float32) == 0).all()


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix, orthonormal."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:
        matrix = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), matrix)
    return matrix / n**0.5


@pytest.mark.parametrize("head_dim,block", [(64, 64), (128, 128), (96, 32), (80, 16)])
def test_hadamard_rotation_is_orthonormal_self_inverse_and_per_vector(head_dim, block):
    """The fast transform equals x @ H (block-diagonal H of the largest power of
    two dividing head_dim), undoes itself, and a vector rotated alone gives the
    same bits as within a batch (what keeps prefix caching exact)."""
    torch.manual_seed(3)
    x = torch.randn(7, NUM_KV_HEADS, head_dim)
    matrix = torch.block_diag(*[_hadamard(block)] * (head_dim // block))
    torch.testing.assert_close(hadamard_rotate(x), x @ matrix, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-5, rtol=1e-5)
    assert torch.equal(hadamard_rotate(x[4:5]), hadamard_rotate(x)[4:5])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_int8_rotation_keeps_precision_beside_an_outlier_channel(kv_cache_dtype):
    """Keys with one channel 30x the others (as real models' keys have): int8
    quantized as they are, the scale fits the outlier and the other channels lose
    most of their bits; the int8 pool rotates first, so its error is several
    times smaller. e4m3's precision is relative, so its pool does not rotate."""
    torch.manual_seed(4)
    x = torch.randn(64, NUM_KV_HEADS, HEAD_DIM)
    x[..., 5] *= 30
    pool = allocate_layer(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, kv_cache_dtype, torch.device("cpu"))
    slots = torch.arange(64)
    stored_k, _ = pool.write(x, x, slots, read_back=True)
    gathered_k, _ = pool.gather(torch.arange(4)[None], torch.float32)
    assert torch.equal(gathered_k[0].transpose(0, 1), stored_k)  # read back = what a later read sees
    plain = dequantize(*quantize(x, kv_cache_dtype), kv_cache_dtype, torch.float32)
    inliers = torch.ones(HEAD_DIM, dtype=torch.bool)
    inliers[5] = False
    pool_error = (stored_k - x)[..., inliers].abs().mean()
    plain_error = (plain - x)[..., inliers].abs().mean()
    if kv_cache_dtype == "int8":
        assert pool_error < plain_error / 3, (pool_error, plain_error)
    else:
        assert torch.equal(stored_k, plain)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_appending_to_a_block_never_changes_its_earlier_tokens(kv_cache_dtype):
    """The chosen rule: each token's scale is fixed when it is written, from its
    own values, so a token 100x larger appended later rescales nothing."""
    torch.manual_seed(1)
    pool = allocate_layer(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, kv_cache_dtype, torch.device("cpu"))
    first = torch.randn(5, NUM_KV_HEADS, HEAD_DIM)
    pool.write(first, first, torch.arange(16, 21))  # block 1, slots 0-4
    before = [t[1].clone() for t in pool.tensors()]
    loud = torch.randn(3, NUM_KV_HEADS, HEAD_DIM) * 100
    pool.write(loud, loud, torch.arange(21, 24))  # the same block, slots 5-7
    for tensor, snapshot in zip(pool.tensors(), before):
        assert torch.equal(tensor[1, :5], snapshot[:5])
    # And writing the same values again gives the same bytes (what prefix caching relies on).
    again = allocate_layer(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, kv_cache_dtype, torch.device("cpu"))
    again.write(first, first, torch.arange(32, 37))
    for tensor, other in zip(pool.tensors(), again.tensors()):
        assert torch.equal(tensor[1, :5], other[2, :5])


@pytest.mark.parametrize("path,kv_cache_dtype", COMBINATIONS)
def test_quantized_decode_attention_is_close_to_fp32(path, kv_cache_dtype):
    if path == "cpp" and load_cpu_kernels() is None:
        pytest.fail("the C++ decode kernel did not build on this machine")
    torch.manual_seed(2)
    lens = [1, 17, 64, 300]
    tables, num_blocks = random_tables(lens, BLOCK_SIZE, random.Random(2))
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in lens]
    pool = allocate_layer(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, kv_cache_dtype,
                          torch.device("cpu"))
    poison_layer(pool)  # slots never written must not be read, even masked
    for table, n, k, v in zip(tables, lens, keys, values):
        pool.write(k, v, torch.tensor(slots_of(table, range(n), BLOCK_SIZE)))
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lens), prefills=[],
    )
    query = torch.randn(len(lens), NUM_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    got = TorchPagedAttention(DECODE_KERNELS[path])._decode(query, pool, metadata, _LayerOptions(scale, None, None))
    # The exact reference: fp32 attention over the unquantized K/V.
    errors = []
    for i, (k, v) in enumerate(zip(keys, values)):
        expected = F.scaled_dot_product_attention(
            query[i].view(1, NUM_HEADS, 1, HEAD_DIM), k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            scale=scale, enable_gqa=True,
        ).view(NUM_HEADS, HEAD_DIM)
        errors.append((got[i] - expected).abs())
    error = torch.cat([e.flatten() for e in errors])
    # int8 steps are ~1/127 of a vector's max (~3 for N(0, 1) at head_dim 64); e4m3 keeps 1/16 relative.
    bound = {"int8": (0.01, 0.05), "fp8_e4m3": (0.04, 0.2)}[kv_cache_dtype]
    assert error.mean() < bound[0] and error.max() < bound[1], (error.mean(), error.max())
    if path != "pytorch":
        # A kernel reads the int8 values and scales exactly as the dequantizing gather does.
        gathered = TorchPagedAttention()._decode(query, pool, metadata, _LayerOptions(scale, None, None))
        torch.testing.assert_close(got, gathered, atol=1e-4, rtol=1e-4)

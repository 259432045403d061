"""Packed GGUF weights: decoding and the quantized matmul, C++ and PyTorch paths,
against `gguf.quants.dequantize` of the same blocks (the oracle).

Tolerances: decoding is exact (every type's scale times its integer is exact in fp32,
so even ``d * q + m`` fused into one FMA rounds as gguf's two steps): decoded weights
equal gguf's on both paths, the AVX-512 register forms included; the matmul sums in another order than a dense matmul, so each output agrees
with the float64 product to 1e-5 of ``|x| @ |W|^T`` (the size of its terms).
bf16 inputs and outputs add bf16 rounding of the output (2^-8 relative).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model import packed_linear
from pagedllm.model.packed_linear import packed_tiles_supported, packing_supported
from pagedllm.model.quantized import modules, packed
from pagedllm.model.quantized.modules import PackedEmbedding, QuantizedLinear
from pagedllm.model.quantized.packed import PackedWeight, dequantize_rows
from tests.model.quantized_blocks import PACKED, random_packed

IN_FEATURES = 512  # whole blocks for every type (32 and 256)
OUT_FEATURES = 37  # odd: a partial tile of 4 weight rows


@pytest.fixture(params=["cpp", "torch"])
def path(request, monkeypatch) -> str:
    """Run a test on the C++ kernels, then on the PyTorch fallback."""
    if request.param == "cpp":
        if load_cpu_kernels() is None:
            pytest.skip("the C++ CPU kernels did not build")
    else:
        monkeypatch.setattr(modules, "cpu_kernels_for", lambda tensor: None)
        monkeypatch.setattr(packed, "cpu_kernels_for", lambda tensor: None)
    return request.param


def _assert_matmul_close(actual: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None,
                         relative: float) -> None:
    x64, w64 = x.double(), dense.double()
    expected = x64 @ w64.T + (bias.double() if bias is not None else 0.0)
    scale = x64.abs() @ w64.abs().T + (bias.double().abs() if bias is not None else 0.0)
    error = (actual.double() - expected).abs()
    assert (error <= relative * scale + 1e-6).all(), f"max error {(error / scale).max().item():.3g} of the terms"


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_decoding_matches_gguf(qtype, path):
    weight, dense = random_packed(qtype, OUT_FEATURES, IN_FEATURES)
    decoded = dequantize_rows(weight.blocks, qtype, IN_FEATURES)
    assert decoded.dtype == torch.float32 and decoded.shape == dense.shape
    assert torch.equal(decoded, dense)
    as_bf16 = PackedWeight(weight.blocks, qtype, weight.shape, torch.bfloat16).dequantize()
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, decoded.bfloat16())


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
# decode-sized (5: all 4 weight rows at once, 8: pairs of weight rows, 11: a pairs group of 6 and one
# of 5), the threshold, prefill-sized
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 11, 48, 49, 130])
def test_matmul_matches_the_dequantized_weight(qtype, rows, path):
    weight, dense = random_packed(qtype, OUT_FEATURES, IN_FEATURES, seed=rows)
    layer = QuantizedLinear([weight], bias=True)
    torch.manual_seed(rows)
    layer.bias.data.normal_()
    x = torch.randn(rows, IN_FEATURES)
    out = layer(x)
    assert out.shape == (rows, OUT_FEATURES) and out.dtype == torch.float32
    _assert_matmul_close(out, x, dense, layer.bias.detach(), 1e-5)


@pytest.mark.parametrize("qtype", [PACKED[0], PACKED[-1]], ids=lambda t: t.name)
def test_prefill_tiles_through_the_packed_fp32_kernel_match_the_dequantized_weight(qtype):
    """Prefill-sized x over a weight of 16-row blocks: two tiles (1008 rows of K = 512, then
    64), through the packed fp32 kernel where this CPU packs fp32 weights, and through MKL."""
    if load_cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels did not build")
    weight, dense = random_packed(qtype, 1072, IN_FEATURES, seed=3)
    layer = QuantizedLinear([weight], bias=False)
    assert layer.packed_tiles == packed_tiles_supported()
    x = torch.randn(130, IN_FEATURES)
    results = {}
    for packed_tiles in (True, False):
        layer.packed_tiles = packed_tiles
        results[packed_tiles] = layer(x)
        _assert_matmul_close(results[packed_tiles], x, dense, None, 1e-5)
    # Another summation order: the flag reached the kernel (where the packed kernel exists).
    assert torch.equal(results[True], results[False]) != load_cpu_kernels().packed_linear_available(torch.float32)


def test_an_amx_cpu_keeps_prefill_tiles_on_mkl_unless_asked(monkeypatch):
    # MKL matched the packed kernel at prefill sizes there; its lead is at decode sizes.
    fp32_packs = packing_supported(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: True)
    assert not packed_tiles_supported()
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "1")
    assert packed_tiles_supported() == fp32_packs
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: False)
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "auto")
    assert packed_tiles_supported() == fp32_packs


@pytest.mark.parametrize("rows", [2, 64])
def test_bf16_activations_round_the_output(rows, path):
    weight, dense = random_packed(PACKED[0], OUT_FEATURES, IN_FEATURES)
    x = torch.randn(rows, IN_FEATURES).bfloat16()
    out = QuantizedLinear([weight], bias=False)(x)
    assert out.dtype == torch.bfloat16
    _assert_matmul_close(out, x.float(), dense, None, 2.0**-8)


def test_fused_segments_of_different_types(path):
    """q (Q4_K), k (Q4_K) and v (Q6_K) as in a Llama Q4_K_M file: two segments, one output."""
    parts = [random_packed(qtype, rows, IN_FEATURES, seed=seed)
             for seed, (qtype, rows) in enumerate([(PACKED[5], 16), (PACKED[5], 8), (PACKED[7], 8)])]
    layer = QuantizedLinear.fused([weight for weight, _ in parts], bias=False)
    assert [qtype.name for qtype in layer.qtypes] == ["Q4_K", "Q6_K"] and layer.out_features == 32
    dense = torch.cat([d for _, d in parts])
    for rows in (4, 60):
        x = torch.randn(rows, IN_FEATURES)
        _assert_matmul_close(layer(x), x, dense, None, 1e-5)


def test_embedding_decodes_the_looked_up_rows(path):
    weight, dense = random_packed(PACKED[1], OUT_FEATURES, IN_FEATURES, dtype=torch.bfloat16)
    embedding = PackedEmbedding(weight)
    ids = torch.tensor([[0, 36], [5, 5]])
    out = embedding(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 2, IN_FEATURES)
    torch.testing.assert_close(out, dense[ids].bfloat16(), rtol=0, atol=0)
    # .to(dtype) reaches the output dtype; the packed blocks stay uint8
    embedding.to(torch.float32)
    assert embedding(ids).dtype == torch.float32 and embedding.blocks.dtype == torch.uint8
    head = embedding.as_linear()
    assert head.blocks_0.data_ptr() == embedding.blocks.data_ptr()  # tied: shared, not copied
    x = torch.randn(3, IN_FEATURES)
    _assert_matmul_close(head(x), x, dense, None, 1e-5)


def test_bad_packed_weights_are_rejected():
    weight, _ = random_packed(PACKED[0], 4, IN_FEATURES)
    with pytest.raises(ValueError, match="multiples of 32"):
        PackedWeight(weight.blocks, weight.qtype, (4, 500), torch.float32)
    with pytest.raises(ValueError, match=r"uint8 \(4, 544\)"):
        PackedWeight(weight.blocks[:, :-1], weight.qtype, (4, IN_FEATURES), torch.float32)
    with pytest.raises(ValueError, match="Q2_K is not a packed type"):
        PackedWeight(weight.blocks, type(weight.qtype).Q2_K, (4, IN_FEATURES), torch.float32)

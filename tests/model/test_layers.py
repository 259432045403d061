"""The decoder's linear layer: fp32 decode-sized matmuls go through the C++
small-batch kernel, whose results must be those of a float64 reference to fp32
rounding, for every shape remainder the tile loop has to handle."""

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.layers import SMALL_BATCH_ROWS, Linear, linear


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, SMALL_BATCH_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (58, 576), (7, 19), (256, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_matches_float64(rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    # fp32 sums of in_features products of unit normals: error ~ eps * sqrt(K) * |terms|.
    torch.testing.assert_close(out.double(), _reference(x, weight, bias), rtol=0, atol=2e-4 * in_features**0.5)


def test_small_batch_linear_reads_strided_rows():
    # A row-strided view (a slice of a wider activation) is read in place.
    wide = torch.randn(6, 200)
    x = wide[:, 8:136]
    weight = torch.randn(40, 128)
    torch.testing.assert_close(linear(x, weight).double(), _reference(x, weight, None), rtol=0, atol=1e-3)


def test_kernel_and_pytorch_agree_on_both_sides_of_the_row_threshold():
    layer = Linear(576, 960)
    for rows in (SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-4, atol=1e-4)


def test_kernel_rejects_mismatched_shapes_with_a_message():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels did not build on this machine")
    with pytest.raises(RuntimeError, match="weight must be contiguous fp32"):
        kernels.linear_small_batch(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        kernels.linear_small_batch(torch.randn(2, 8).double(), torch.randn(4, 8))

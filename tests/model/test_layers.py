"""The decoder's linear layer and gated-MLP activation.

fp32 and bf16 decode-sized matmuls go through the C++ small-batch kernel, whose
results must be those of a float64 reference to fp32 rounding (bf16: then one
rounding to bf16), for every shape remainder the tile loop has to handle. ``silu_and_mul`` runs in one C++ pass:
bit-identical to PyTorch's silu-then-mul in bf16 (it rounds where they do),
equal to fp32 rounding in fp32."""

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model import layers
from pagedllm.model.layers import AMX_BF16_SMALL_BATCH_ROWS, SMALL_BATCH_ROWS, Linear, linear, silu_and_mul


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


# Rows on both sides of SMALL_BATCH_ROWS: the C++ kernel below it, PyTorch (in fp32
# where the CPU has no native bf16) above it.
@pytest.mark.parametrize("rows", [1, 3, 4, 13, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (7, 19), (256, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_rounds_an_fp32_sum_once(rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    # The exact sum, rounded once to bf16 (half an ulp: 2**-9 relative), plus fp32 summation error.
    exact = _reference(x, weight, bias)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=2e-4 * in_features**0.5)


class SmallBatchSpy:
    """The C++ kernels with ``linear_small_batch`` counting its calls."""

    def __init__(self, kernels) -> None:
        self.kernels, self.calls = kernels, 0

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def linear_small_batch(self, *args):
        self.calls += 1
        return self.kernels.linear_small_batch(*args)


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_on_an_amx_cpu_leaves_all_but_a_few_rows_to_onednn(amx, monkeypatch):
    # oneDNN's AMX GEMM costs the same from 1 to ~32 rows; the kernel only wins below ~10.
    if load_cpu_kernels() is None:
        pytest.fail("the C++ CPU kernels did not build on this machine")
    spy = SmallBatchSpy(load_cpu_kernels())
    monkeypatch.setattr(layers, "cpu_kernels_for", lambda x: spy)
    monkeypatch.setattr(layers, "cpu_has_amx", lambda: amx)
    weight = torch.randn(64, 32)
    for dtype, rows, kernel in [(torch.bfloat16, AMX_BF16_SMALL_BATCH_ROWS, True),
                                (torch.bfloat16, AMX_BF16_SMALL_BATCH_ROWS + 1, not amx),
                                (torch.bfloat16, SMALL_BATCH_ROWS, not amx),
                                (torch.float32, SMALL_BATCH_ROWS, True),
                                (torch.float32, SMALL_BATCH_ROWS + 1, False)]:
        x = torch.randn(rows, 32).to(dtype)
        before = spy.calls
        out = linear(x, weight.to(dtype))
        assert (spy.calls > before) == kernel, (dtype, rows)
        torch.testing.assert_close(out.double(), _reference(x, weight.to(dtype), None), rtol=2**-8, atol=2e-3)


def test_bf16_kernel_reads_strided_rows():
    wide = torch.randn(6, 200).bfloat16()
    weight = torch.randn(40, 128).bfloat16()
    torch.testing.assert_close(linear(wide[:, 8:136], weight), linear(wide[:, 8:136].contiguous(), weight),
                               rtol=0, atol=0)


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
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        kernels.linear_small_batch(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="of x's dtype"):
        kernels.linear_small_batch(torch.randn(2, 8).bfloat16(), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        kernels.linear_small_batch(torch.randn(2, 8).double(), torch.randn(4, 8))


def _silu_then_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# Widths: the model's, whole vectors only, and tails of 7 and 9 lanes past whole vectors.
@pytest.mark.parametrize("width", [1536, 32, 7, 41])
def test_silu_and_mul_bf16_is_bit_identical_to_pytorch(width):
    generator = torch.Generator().manual_seed(width)
    # Up to +-40: both tails of the sigmoid, where exp over- and underflows.
    x = (torch.randn(37, 2 * width, generator=generator) * 10).clamp(-40, 40).bfloat16()
    assert torch.equal(silu_and_mul(x), _silu_then_mul(x))


@pytest.mark.parametrize("width", [1536, 32, 7, 41])
def test_silu_and_mul_fp32_matches_pytorch_to_rounding(width):
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(37, 2 * width, generator=generator) * 10
    torch.testing.assert_close(silu_and_mul(x), _silu_then_mul(x), rtol=2e-6, atol=1e-7)
    big = torch.tensor([[-200.0, -90.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(silu_and_mul(big), _silu_then_mul(big))


def test_silu_and_mul_reads_row_strided_input_and_keeps_other_dtypes_on_pytorch():
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows 100 apart: a slice of a wider activation
    torch.testing.assert_close(silu_and_mul(x), _silu_then_mul(x), rtol=2e-6, atol=1e-7)
    half = torch.randn(3, 16).half()
    assert torch.equal(silu_and_mul(half), _silu_then_mul(half))


def test_silu_and_mul_kernel_rejects_bad_input_with_a_message():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels did not build on this machine")
    with pytest.raises(RuntimeError, match="must be \\[rows, 2 \\* width\\]"):
        kernels.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.silu_and_mul(torch.randn(2, 8).double())


@pytest.mark.parametrize("config_kwargs", [
    dict(hidden_size=576, num_attention_heads=9),  # SmolLM2-135M's shape
    dict(hidden_size=256, num_attention_heads=4, head_dim=128, rope_theta=1e6),  # explicit head_dim (Qwen3)
])
def test_default_rope_frequencies_equal_transformers_bit_for_bit(config_kwargs):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedllm.model.rotary import rope_inv_freq

    config = LlamaConfig(**config_kwargs)
    expected, expected_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    inv_freq, scaling = rope_inv_freq(config)
    assert torch.equal(inv_freq, expected) and scaling == expected_scaling

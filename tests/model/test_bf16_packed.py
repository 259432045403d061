"""bf16 weights packed for VDPBF16PS: the layout, the C++ kernel against fp32 sums,
and the swap of a loaded model's linear layers (pagedllm/model/bf16_packed.py)."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.bf16_packed import (PackedBf16Linear, bf16_packing_supported, pack_bf16_linears,
                                        pack_bf16_weight, pack_bf16_weight_in_place)
from pagedllm.model.layers import Linear
from tests.conftest import assert_pool_free

CPU = torch.device("cpu")


def kernel_built() -> bool:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ CPU kernels did not build on this machine")
    return kernels.bf16_packed_linear_available()


needs_kernel = pytest.mark.skipif("not kernel_built()", reason="the C++ kernels were built without AVX-512 BF16")


def test_packed_layout_puts_16_outputs_by_one_pair_of_inputs_per_vector():
    weight = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).bfloat16()
    packed = pack_bf16_weight(weight)
    assert packed.shape == (2, 3, 16, 2) and packed.is_contiguous()
    for out_index, in_index in [(0, 0), (5, 3), (17, 4), (31, 5)]:
        assert packed[out_index // 16, in_index // 2, out_index % 16, in_index % 2] == weight[out_index, in_index]


@pytest.mark.parametrize("out_features", [16, 48, 2064])  # 2064 = 129 blocks: two chunks of 64 and one more
def test_in_place_packing_permutes_the_weights_own_bytes(out_features):
    weight = torch.randn(out_features, 40).bfloat16()
    expected = pack_bf16_weight(weight)
    address = weight.data_ptr()
    packed = pack_bf16_weight_in_place(weight)
    assert packed.data_ptr() == address and torch.equal(packed, expected)
    with pytest.raises(ValueError, match="contiguous"):
        pack_bf16_weight_in_place(torch.zeros(40, 32, dtype=torch.bfloat16).t())


@pytest.mark.parametrize("shape", [(24, 8), (32, 7)])
def test_unpackable_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="out_features % 16 == 0 and even in_features"):
        pack_bf16_weight(torch.zeros(shape, dtype=torch.bfloat16))


# (rows, in, out): row groups of 8 and their remainders 1-7, tiles of 48 outputs and
# a last tile of 1 or 2 vectors, SmolLM2's K = 576 and 1536.
SHAPES = [(1, 576, 960), (7, 64, 16), (8, 1536, 576), (13, 576, 32), (20, 2, 48), (33, 576, 80), (130, 96, 64)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_rounds_the_fp32_sums_once(shape, with_bias):
    rows, in_features, out_features = shape
    torch.manual_seed(sum(shape))
    x = torch.randn(rows, in_features).bfloat16()
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    out = PackedBf16Linear(weight, bias)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    # Products of bf16 are exact in fp32 and the sums differ from exact by fp32 rounding:
    # the output is the exact result rounded to bf16 (half an ulp, 2^-9 relative), or
    # its neighbour where the fp32 sum lands across a rounding boundary.
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()


@needs_kernel
def test_strided_rows_and_leading_dims():
    torch.manual_seed(3)
    weight = torch.randn(48, 64).bfloat16()
    layer = PackedBf16Linear(weight, None)
    wide = torch.randn(5, 100).bfloat16()
    rows = wide[:, 10:74]  # rows 100 apart, as a view into a fused projection's output
    torch.testing.assert_close(layer(rows), layer(rows.contiguous()), rtol=0, atol=0)
    batched = torch.randn(2, 3, 64).bfloat16()
    torch.testing.assert_close(layer(batched), layer(batched.view(6, 64)).view(2, 3, 48), rtol=0, atol=0)
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 48)


@needs_kernel
def test_a_row_comes_out_the_same_in_any_batch():
    """Each row's sums run in one order whatever the row count (no split along K, no
    cross-row reduction): decode rows do not change with the batch around them."""
    torch.manual_seed(4)
    layer = PackedBf16Linear(torch.randn(96, 576).bfloat16(), None)
    x = torch.randn(21, 576).bfloat16()
    whole = layer(x)
    for rows in (slice(0, 1), slice(3, 11), slice(13, 21), slice(5, 6)):
        torch.testing.assert_close(layer(x[rows]), whole[rows], rtol=0, atol=0)


def test_packing_is_off_by_environment_and_for_other_dtypes(monkeypatch):
    assert not bf16_packing_supported(CPU, torch.float32)
    assert not bf16_packing_supported(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_BF16_PACKED", "0")
    assert not bf16_packing_supported(CPU, torch.bfloat16)
    model = torch.nn.Sequential(Linear(64, 32)).bfloat16()
    assert pack_bf16_linears(model) == 0 and type(model[0]) is Linear


@needs_kernel
def test_pack_swaps_packable_layers_only_and_keeps_the_function():
    if torch.cpu._is_amx_tile_supported():
        assert not bf16_packing_supported(CPU, torch.bfloat16)  # oneDNN's AMX GEMM stays
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 48, bias=True), Linear(48, 24)).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    dense_hidden = model[0](x)
    dense_weight_address = model[0].weight.data_ptr()
    assert pack_bf16_linears(model) == 1
    assert isinstance(model[0], PackedBf16Linear) and type(model[1]) is Linear  # 24 outputs: not packable
    assert model[0].bias is not None and "packed_weight" not in model.state_dict()
    assert model[0].packed_weight.data_ptr() == dense_weight_address  # packed in its own storage
    torch.testing.assert_close(model[0](x).float(), dense_hidden.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_packs_a_bf16_model_and_generates_as_the_dense_one(arch, tiny_model_dir, monkeypatch):
    """llama ties its LM head (the head gets a packed copy of the embedding), qwen2 has
    q/k/v biases and its own head."""
    folder = tiny_model_dir(arch)
    prompts = ["The history of computing", "Blocks can be shared between sequences", "A page table"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    generations = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_BF16_PACKED", flag)
        llm = LLM(folder, dtype="bfloat16", num_kv_blocks=64, debug_invariants=True)
        model = llm.llm_engine.model
        packed = flag == "1" and bf16_packing_supported(CPU, torch.bfloat16)
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedBf16Linear) == packed
        assert isinstance(getattr(model, "lm_head", None), PackedBf16Linear) == packed
        generations[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_free(llm)
    # The same bf16 roundings of sums taken in another order: on this model's
    # well-separated logits the greedy tokens do not move.
    assert generations["1"] == generations["0"]

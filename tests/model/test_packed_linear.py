"""fp32 and bf16 weights packed for the C++ packed kernel: the layout, the kernel
against exact sums, the tied embedding read out of the packed head, and the swap of a
loaded model's layers (pagedllm/model/packed_linear.py)."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model import packed_linear
from pagedllm.model.layers import Embedding, Linear
from pagedllm.model.packed_linear import (PackedLinear, PackedTiedEmbedding, pack_linears, pack_weight,
                                          pack_weight_in_place, packing_supported)
from tests.conftest import assert_pool_free

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def kernel_built(dtype: torch.dtype) -> bool:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.fail("the C++ CPU kernels did not build on this machine")
    return kernels.packed_linear_available(dtype)


def needs_kernel(dtype: torch.dtype) -> None:
    if not kernel_built(dtype):
        pytest.skip(f"the C++ kernels were built without the packed {dtype} kernel (no AVX-512 / AVX-512 BF16)")


def group(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_layout_puts_16_outputs_by_one_group_of_inputs_per_vector(dtype):
    weight = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).to(dtype)
    packed = pack_weight(weight)
    g = group(dtype)
    assert packed.shape == (2, 6 // g, 16, g) and packed.is_contiguous()
    for out_index, in_index in [(0, 0), (5, 3), (17, 4), (31, 5)]:
        assert packed[out_index // 16, in_index // g, out_index % 16, in_index % g] == weight[out_index, in_index]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features", [16, 48, 2064])  # 2064 = 129 blocks: two chunks of 64 and one more
def test_in_place_packing_permutes_the_weights_own_bytes(out_features, dtype):
    weight = torch.randn(out_features, 40).to(dtype)
    expected = pack_weight(weight)
    address = weight.data_ptr()
    packed = pack_weight_in_place(weight)
    assert packed.data_ptr() == address and torch.equal(packed, expected)
    with pytest.raises(ValueError, match="contiguous"):
        pack_weight_in_place(torch.zeros(40, 32, dtype=dtype).t())


@pytest.mark.parametrize("dtype,shape,message", [
    (torch.bfloat16, (24, 8), "out_features % 16 == 0 and even in_features"),
    (torch.bfloat16, (32, 7), "out_features % 16 == 0 and even in_features"),
    (torch.float32, (24, 8), r"out_features % 16 == 0, not \[24, 8\]"),
    (torch.float16, (32, 8), "out_features % 16 == 0"),
])
def test_unpackable_weights_are_refused(dtype, shape, message):
    with pytest.raises(ValueError, match=message):
        pack_weight(torch.zeros(shape, dtype=dtype))


def test_odd_in_features_pack_in_fp32():
    assert pack_weight(torch.zeros(32, 7)).shape == (2, 7, 16, 1)


# (rows, in, out): row groups of 8 and their remainders 1-7, tiles of 48 outputs and
# a last tile of 1 or 2 vectors, SmolLM2's K = 576 and 1536.
SHAPES = [(1, 576, 960), (7, 64, 16), (8, 1536, 576), (13, 576, 32), (20, 2, 48), (33, 576, 80), (130, 96, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_sums_in_fp32_and_rounds_once(shape, with_bias, dtype):
    needs_kernel(dtype)
    rows, in_features, out_features = shape
    torch.manual_seed(sum(shape))
    x = torch.randn(rows, in_features).to(dtype)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    out = PackedLinear(weight, bias)(x)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ weight.double().abs().t()) + (0 if bias is None else bias.double().abs())
    if dtype == torch.bfloat16:
        # Products of bf16 are exact in fp32 and the sums differ from exact by fp32 rounding:
        # the output is the exact result rounded to bf16 (half an ulp, 2^-9 relative), or
        # its neighbour where the fp32 sum lands across a rounding boundary.
        assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    else:
        # An fp32 sum of K products in order: error below K ulps of the sum of magnitudes.
        assert ((out.double() - exact).abs() <= scale * (in_features + 1) * 2**-24).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_leading_dims(dtype):
    needs_kernel(dtype)
    torch.manual_seed(3)
    layer = PackedLinear(torch.randn(48, 64).to(dtype), None)
    wide = torch.randn(5, 100).to(dtype)
    rows = wide[:, 10:74]  # rows 100 apart, as a view into a fused projection's output
    torch.testing.assert_close(layer(rows), layer(rows.contiguous()), rtol=0, atol=0)
    batched = torch.randn(2, 3, 64).to(dtype)
    torch.testing.assert_close(layer(batched), layer(batched.view(6, 64)).view(2, 3, 48), rtol=0, atol=0)
    assert layer(torch.empty(0, 64, dtype=dtype)).shape == (0, 48)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_comes_out_the_same_in_any_batch(dtype):
    """Each row's sums run in one order whatever the row count (no split along K, no
    cross-row reduction): decode rows do not change with the batch around them."""
    needs_kernel(dtype)
    torch.manual_seed(4)
    layer = PackedLinear(torch.randn(96, 576).to(dtype), None)
    x = torch.randn(21, 576).to(dtype)
    whole = layer(x)
    for rows in (slice(0, 1), slice(3, 11), slice(13, 21), slice(5, 6)):
        torch.testing.assert_close(layer(x[rows]), whole[rows], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_rows_read_the_dense_rows_back_exactly(dtype):
    weight = torch.randn(80, 12).to(dtype)
    layer = PackedLinear(weight.clone(), None, in_place=True)
    ids = torch.tensor([[0, 79, 16], [15, 17, 0]])
    rows = layer.weight_rows(ids)
    assert rows.shape == (2, 3, 12) and torch.equal(rows, weight[ids])
    assert torch.equal(PackedTiedEmbedding(layer)(ids), weight[ids])


def test_packing_is_off_by_environment_and_for_other_dtypes_and_devices(monkeypatch):
    assert not packing_supported(CPU, torch.float16)
    assert not packing_supported(torch.device("cuda"), torch.float32)
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "0")
    assert not packing_supported(CPU, torch.float32) and not packing_supported(CPU, torch.bfloat16)
    model = torch.nn.Sequential(Linear(64, 32))
    assert pack_linears(model) == 0 and type(model[0]) is Linear
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "auto")
    monkeypatch.setenv("PAGEDLLM_BF16_PACKED", "0")  # the first, bf16-only switch
    assert not packing_supported(CPU, torch.bfloat16)
    assert packing_supported(CPU, torch.float32) == kernel_built(torch.float32)


@pytest.mark.parametrize("amx", [False, True])
def test_fp32_packs_on_every_avx512_cpu(amx, monkeypatch):
    # fp32 has no AMX path: the packed kernel beats MKL on the AMX Xeon as on Zen 4.
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: amx)
    assert packing_supported(CPU, torch.float32) == kernel_built(torch.float32)


def test_an_amx_cpu_packs_bf16_only_when_asked(monkeypatch):
    # There oneDNN's AMX GEMM beats the VDPBF16PS kernel from ~10 rows up.
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: True)
    assert not packing_supported(CPU, torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "1")
    assert packing_supported(CPU, torch.bfloat16) == kernel_built(torch.bfloat16)
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: False)
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "auto")
    assert packing_supported(CPU, torch.bfloat16) == kernel_built(torch.bfloat16)


class TiedModel(torch.nn.Module):
    """The shape pack_linears looks for in a decoder: model.embed_tokens, a tied head."""

    tie_word_embeddings = True

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = Embedding(64, 32)
        self.model.proj = Linear(32, 48, bias=True)
        self.model.odd = Linear(48, 24)  # 24 outputs: not packable


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_swaps_packable_layers_and_the_tied_head_in_place(dtype, monkeypatch):
    needs_kernel(dtype)
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "1")  # also on an AMX CPU: the swap is what is tested
    torch.manual_seed(0)
    model = TiedModel().to(dtype)
    x = torch.randn(9, 32).to(dtype)
    ids = torch.tensor([3, 63, 17])
    dense_hidden, dense_rows = model.model.proj(x), model.model.embed_tokens(ids)
    dense_logits = x.double() @ model.model.embed_tokens.weight.double().t()
    addresses = model.model.proj.weight.data_ptr(), model.model.embed_tokens.weight.data_ptr()
    assert pack_linears(model) == 2
    assert isinstance(model.model.proj, PackedLinear) and type(model.model.odd) is Linear
    assert model.model.proj.bias is not None and "packed_weight" not in model.state_dict()
    # Packed in their own storage: the tied matrix is held once, by the head.
    assert (model.model.proj.packed_weight.data_ptr(), model.lm_head.packed_weight.data_ptr()) == addresses
    assert isinstance(model.model.embed_tokens, PackedTiedEmbedding) and model.model.embed_tokens.head is model.lm_head
    assert torch.equal(model.model.embed_tokens(ids), dense_rows)
    tolerance = {"rtol": 2**-7, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(model.model.proj(x).float(), dense_hidden.float(), **tolerance)
    torch.testing.assert_close(model.lm_head(x).double(), dense_logits, **tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_packs_a_model_and_generates_as_the_dense_one(arch, dtype, tiny_model_dir, monkeypatch):
    """llama ties its LM head (the embedding becomes the packed head's rows), qwen2 has
    q/k/v biases and its own head."""
    folder = tiny_model_dir(arch)
    prompts = ["The history of computing", "Blocks can be shared between sequences", "A page table"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    generations = {}
    for flag in ("auto", "0"):
        monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", flag)
        llm = LLM(folder, dtype=dtype, num_kv_blocks=64, debug_invariants=True)
        model = llm.llm_engine.model
        packed = flag == "auto" and packing_supported(CPU, getattr(torch, dtype))
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear) == packed
        assert isinstance(getattr(model, "lm_head", None), PackedLinear) == packed
        assert isinstance(model.model.embed_tokens, PackedTiedEmbedding) == (packed and arch == "llama")
        generations[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_free(llm)
    # The same roundings of sums taken in another order: on this model's
    # well-separated logits the greedy tokens do not move.
    assert generations["auto"] == generations["0"]

"""LoRA adapters read from disk (issue 44): PEFT folders and llama.cpp GGUF LoRA files come back as
the tensors PEFT saved, scaled as PEFT (or llama.cpp) scales them, and every adapter that does not
fit the base model, or uses an option that is not served, is refused with a message naming what
to change, by ``check_adapter`` (headers only) and ``read_adapter`` alike.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pagedllm.bench.hf_reference import load_hf_model
from pagedllm.lora.adapter_files import check_adapter, read_adapter
from pagedllm.lora.page_layout import projection_shapes
from pagedllm.lora.weights import LORA_MODULES, LoRAWeights
from tests.lora.adapters import make_peft_adapter, peft_greedy, write_gguf_lora

READERS = pytest.mark.parametrize("reader", [check_adapter, read_adapter], ids=["check", "read"])
PREFIX = "base_model.model.model.layers."
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def config(tiny_llama):
    return AutoConfig.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    return make_peft_adapter(tiny_llama, str(tmp_path_factory.mktemp("lora") / "all"))


@pytest.fixture
def copy(adapter, tmp_path) -> str:
    """A copy of the adapter folder, for a test to break."""
    return shutil.copytree(adapter, tmp_path / "copy")


def _assert_same(weights: LoRAWeights, expected: LoRAWeights, atol: float = 0.0) -> None:
    assert (weights.rank, weights.scaling) == (expected.rank, expected.scaling)
    assert weights.tensors.keys() == expected.tensors.keys()
    for key, pair in weights.tensors.items():
        for got, want in zip(pair, expected.tensors[key]):
            assert got.dtype == torch.float32 and got.device.type == "cpu" and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_a_peft_folder_reads_back_as_saved(adapter, config):
    saved = load_file(os.path.join(adapter, WEIGHTS))
    weights = read_adapter(adapter, config, max_lora_rank=16)
    assert (weights.rank, weights.scaling, weights.target_modules) == (8, 16 / 8, LORA_MODULES)
    assert len(weights.tensors) == config.num_hidden_layers * len(LORA_MODULES)
    for (layer, module), (a, b) in weights.tensors.items():
        parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        stem = f"{PREFIX}{layer}.{parent}.{module}"
        assert torch.equal(a, saved[f"{stem}.lora_A.weight"]) and torch.equal(b, saved[f"{stem}.lora_B.weight"])
        assert a.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
    info = check_adapter(adapter, config, max_lora_rank=8)
    assert (info.rank, info.scaling, info.target_modules) == (8, 2.0, LORA_MODULES)


def test_rslora_scales_by_the_square_root_and_a_subset_targets_only_its_modules(tiny_llama, config, tmp_path):
    folder = make_peft_adapter(tiny_llama, str(tmp_path / "qv"), rank=4, alpha=8, targets=("v_proj", "q_proj"),
                               use_rslora=True)
    weights = read_adapter(folder, config, max_lora_rank=16)
    assert weights.scaling == pytest.approx(8 / math.sqrt(4))
    assert weights.target_modules == ("q_proj", "v_proj")
    assert set(weights.tensors) == {(layer, m) for layer in range(2) for m in ("q_proj", "v_proj")}
    assert check_adapter(folder, config, max_lora_rank=4).target_modules == ("q_proj", "v_proj")


def _merged_logits(base_dir: str, weights: LoRAWeights, ids: torch.Tensor) -> torch.Tensor:
    """The base model with ``scaling * B @ A`` added to each targeted weight."""
    model = load_hf_model(base_dir)
    with torch.no_grad():
        for (layer, module), (a, b) in weights.tensors.items():
            block = model.model.layers[layer]
            parent = block.self_attn if hasattr(block.self_attn, module) else block.mlp
            getattr(parent, module).weight += weights.scaling * b @ a
        return model(ids).logits


def test_read_weights_compute_what_peft_computes_and_change_its_greedy_output(tiny_llama, adapter, config, tmp_path):
    from peft import PeftModel

    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(load_hf_model(tiny_llama), adapter).eval()(ids).logits
    gguf_file = write_gguf_lora(adapter, str(tmp_path / "a.gguf"))
    for weights in (read_adapter(adapter, config, 16), read_adapter(gguf_file, config, 16)):
        torch.testing.assert_close(_merged_logits(tiny_llama, weights, ids), expected, atol=1e-4, rtol=1e-4)
    prompts = [[5, 6, 7, 8], [300, 200, 100]]
    assert peft_greedy(tiny_llama, adapter, prompts, 6) != peft_greedy(tiny_llama, None, prompts, 6)


def _edit_config(**changes) -> Callable[[str], None]:
    def edit(folder: str) -> None:
        path = os.path.join(folder, "adapter_config.json")
        with open(path) as handle:
            settings = json.load(handle)
        settings.update(changes)
        with open(path, "w") as handle:
            json.dump(settings, handle)
    return edit


def _edit_tensors(change: Callable[[dict[str, torch.Tensor]], None], **config_changes) -> Callable[[str], None]:
    def edit(folder: str) -> None:
        path = os.path.join(folder, WEIGHTS)
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path)
        _edit_config(**config_changes)(folder)
    return edit


def _rename_layer(tensors: dict[str, torch.Tensor]) -> None:
    for key in [k for k in tensors if k.startswith(f"{PREFIX}1.")]:
        tensors[key.replace(f"{PREFIX}1.", f"{PREFIX}2.")] = tensors.pop(key)


def _truncate(folder: str) -> None:
    path = os.path.join(folder, WEIGHTS)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


Q0 = f"{PREFIX}0.self_attn.q_proj"
REFUSALS = {
    "peft_type": (_edit_config(peft_type="LOHA"), "peft_type is 'LOHA'; only LORA"),
    "dora": (_edit_config(use_dora=True), "use_dora=True: DoRA is not served"),
    "bias": (_edit_config(bias="all"), "bias='all': trained biases"),
    "modules_to_save": (_edit_config(modules_to_save=["score"]), "modules_to_save=\\['score'\\]"),
    "fan_in_fan_out": (_edit_config(fan_in_fan_out=True), "fan_in_fan_out=True"),
    "rank_pattern": (_edit_config(rank_pattern={"q_proj": 4}), "rank_pattern=.*one r for every module"),
    "alpha_pattern": (_edit_config(alpha_pattern={"q_proj": 4}), "alpha_pattern=.*one lora_alpha"),
    "lm_head_target": (_edit_config(target_modules=["q_proj", "lm_head"]), "targets 'lm_head' \\(the output"),
    "embed_target": (_edit_config(target_modules=["embed_tokens"]), "targets 'embed_tokens' \\(the token"),
    "lm_head_tensors": (_edit_tensors(lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(100, 8)}), target_modules=".*"), "targets 'lm_head'"),
    "embed_tensors": (_edit_tensors(lambda t: t.update({
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 100)}), target_modules=".*"),
        "targets 'embed_tokens'"),
    "layer": (_edit_tensors(_rename_layer), "layer 2 .*the base model has 2 layers"),
    "a_without_b": (_edit_tensors(lambda t: t.pop(f"{Q0}.lora_B.weight")), "q_proj has lora_A without its lora_B"),
    "in_features": (_edit_tensors(lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(8, 32)})),
                    "lora_A is \\[8, 32\\], but the base model's projection takes 64 input features"),
    "mixed_ranks": (_edit_tensors(lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 64),
                                                      f"{Q0}.lora_B.weight": torch.zeros(64, 4)})), "mixes ranks"),
    "declared_rank": (_edit_config(r=4), "says r=4 but its tensors have rank 8"),
    "dora_tensor": (_edit_tensors(lambda t: t.update({f"{Q0}.lora_magnitude_vector": torch.ones(64)})),
                    "unexpected tensor"),
    "int_tensor": (_edit_tensors(lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(8, 64, dtype=torch.int32)})),
                   "is I32; LoRA tensors must be"),
    "no_config": (lambda f: os.remove(os.path.join(f, "adapter_config.json")), "has no adapter_config.json"),
    "bad_json": (lambda f: open(os.path.join(f, "adapter_config.json"), "w").write("{"), "not valid JSON"),
    "pickle": (lambda f: os.rename(os.path.join(f, WEIGHTS), os.path.join(f, "adapter_model.bin")),
               "adapter_model.bin, a pickle.*save the adapter with safetensors"),
    "no_weights": (lambda f: os.remove(os.path.join(f, WEIGHTS)), "has no adapter_model.safetensors"),
    "truncated": (_truncate, "adapter_model.safetensors' is not a readable safetensors file .*truncated"),
}


@READERS
@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_unservable_peft_folder_is_refused_by_name(case, reader, copy, config):
    breaks, message = REFUSALS[case]
    breaks(str(copy))
    with pytest.raises(ValueError, match=message):
        reader(str(copy), config, 16)


@READERS
def test_a_rank_above_max_lora_rank_is_refused(reader, adapter, config):
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank 4; raise max_lora_rank"):
        reader(adapter, config, 4)


BASE_CHANGES = {
    "kv_heads": ({"num_key_value_heads": 4}, "layer 0 k_proj: lora_B is \\[32, 8\\].*64 output features"),
    "head_dim": ({"head_dim": 32}, "layer 0 q_proj: lora_B is \\[64, 8\\].*128 output features"),
    "intermediate": ({"intermediate_size": 256}, "layer 0 gate_proj: lora_B is \\[128, 8\\].*256 output"),
    "hidden": ({"hidden_size": 128}, "layer 0 q_proj: lora_A is \\[8, 64\\].*128 input"),
    "layers": ({"num_hidden_layers": 1}, "layer 1 q_proj: the base model has 1 layers"),
}


@READERS
@pytest.mark.parametrize("case", list(BASE_CHANGES))
def test_an_adapter_for_another_base_model_is_refused(case, reader, adapter, config):
    changes, message = BASE_CHANGES[case]
    other = type(config).from_dict({**config.to_dict(), **changes})
    with pytest.raises(ValueError, match=message):
        reader(adapter, other, 16)


def test_the_projection_shapes_follow_head_dim_and_kv_heads():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=32)
    assert projection_shapes(config) == {"q_proj": (64, 128), "k_proj": (64, 32), "v_proj": (64, 32),
                                       "o_proj": (128, 64), "gate_proj": (64, 96), "up_proj": (64, 96),
                                       "down_proj": (96, 64)}


def test_a_path_that_is_no_adapter_is_refused(adapter, config, tmp_path):
    with pytest.raises(ValueError, match="no such folder or file"):
        read_adapter(str(tmp_path / "missing"), config, 16)
    with pytest.raises(ValueError, match="one file of a PEFT folder; pass the folder itself"):
        check_adapter(os.path.join(adapter, WEIGHTS), config, 16)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither a PEFT folder nor a llama.cpp .gguf"):
        read_adapter(str(tmp_path / "notes.txt"), config, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype, atol", [("f32", 0.0), ("f16", 1e-3), ("bf16", 1e-2)])
def test_a_gguf_lora_reads_back_as_its_peft_folder(arch, dtype, atol, adapter, config, tmp_path):
    path = write_gguf_lora(adapter, str(tmp_path / f"{arch}-{dtype}.gguf"), arch, dtype=dtype)
    expected = read_adapter(adapter, config, 16)
    _assert_same(read_adapter(path, config, 16), expected, atol)
    info = check_adapter(path, config, 8)
    assert (info.rank, info.scaling, info.target_modules) == (8, 2.0, LORA_MODULES)
    # llama's q/k lora_b rows are stored in llama.cpp's rope order: the reader has undone that.
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.0.attn_q.weight.lora_b"]
    stored_b = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(64, 8).copy())
    permuted = not torch.allclose(stored_b, expected.tensors[(0, "q_proj")][1], atol=atol)
    assert permuted == (arch == "llama")


def test_gguf_scaling_is_llama_cpps(tiny_llama, adapter, config, tmp_path):
    """alpha / rank, rslora or not (the converter writes lora_alpha as is); 1.0 when alpha is 0."""
    rslora = make_peft_adapter(tiny_llama, str(tmp_path / "rs"), rank=4, alpha=8, targets=("q_proj",),
                               use_rslora=True)
    assert read_adapter(write_gguf_lora(rslora, str(tmp_path / "rs.gguf")), config, 16).scaling == 8 / 4
    zero = shutil.copytree(adapter, tmp_path / "zero")
    _edit_config(lora_alpha=0)(str(zero))
    assert check_adapter(write_gguf_lora(str(zero), str(tmp_path / "zero.gguf")), config, 16).scaling == 1.0


def test_checking_a_gguf_lora_decodes_no_tensor(adapter, config, tmp_path, monkeypatch):
    import pagedllm.lora.gguf_lora as gguf_lora

    path = write_gguf_lora(adapter, str(tmp_path / "a.gguf"))

    def refuse(*args):
        raise AssertionError("decoded a tensor")

    monkeypatch.setattr(gguf_lora, "dequantize_tensor", refuse)
    assert check_adapter(path, config, 16).rank == 8


def _write_gguf(path: str, tensors: dict[str, np.ndarray], general_type: str = "adapter",
                adapter_type: str = "lora", arch: str = "llama") -> str:
    """A hand-made GGUF file: ``tensors`` in torch order (A [rank, in], B [out, rank])."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 16.0)
    for name, data in tensors.items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


A, B_Q, B_V = np.zeros((8, 64)), np.zeros((64, 8)), np.zeros((32, 8))
GOOD = {"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B_Q}
GGUF_REFUSALS = {
    "model": ({"general_type": "model"}, GOOD, "is not a LoRA adapter: general.type is 'model'"),
    "control_vector": ({"adapter_type": "control_vector"}, GOOD, "adapter.type is 'control_vector', not 'lora'"),
    "arch": ({"arch": "gpt2"}, GOOD, "unsupported GGUF architecture 'gpt2'"),
    "embed": ({}, {"token_embd.weight.lora_a": A, "token_embd.weight.lora_b": B_Q}, "targets 'embed_tokens'"),
    "lm_head": ({}, {"output.weight.lora_a": A, "output.weight.lora_b": B_Q}, "targets 'lm_head'"),
    "fused_qkv": ({}, {"blk.0.attn_qkv.weight.lora_a": A}, "targets 'attn_qkv'"),
    "a_only": ({}, {"blk.0.attn_v.weight.lora_a": A}, "layer 0 v_proj has lora_A without its lora_B"),
    "layer": ({}, {"blk.7.attn_v.weight.lora_a": A, "blk.7.attn_v.weight.lora_b": B_V}, "layer 7 v_proj"),
    "shape": ({}, {"blk.0.attn_v.weight.lora_a": A, "blk.0.attn_v.weight.lora_b": B_Q},
              "lora_B is \\[64, 8\\].*32 output features"),
    "norm": ({}, {**GOOD, "blk.0.attn_norm.weight": np.ones(64)}, "norm weight 'blk.0.attn_norm.weight'"),
    "other": ({}, {**GOOD, "blk.0.attn_q.weight": A}, "unexpected tensor 'blk.0.attn_q.weight'"),
}


@READERS
@pytest.mark.parametrize("case", list(GGUF_REFUSALS))
def test_an_unservable_gguf_lora_is_refused_by_name(case, reader, config, tmp_path):
    options, tensors, message = GGUF_REFUSALS[case]
    path = _write_gguf(str(tmp_path / "a.gguf"), tensors, **options)
    with pytest.raises(ValueError, match=message):
        reader(path, config, 16)


@READERS
def test_a_quantized_or_cut_short_gguf_lora_is_refused(reader, adapter, config, tmp_path):
    path = write_gguf_lora(adapter, str(tmp_path / "q8.gguf"), dtype="q8_0")  # A rows of 64 fill Q8_0 blocks
    with pytest.raises(ValueError, match="is Q8_0; only F32, F16 and BF16 LoRA tensors are read"):
        reader(path, config, 16)
    path = write_gguf_lora(adapter, str(tmp_path / "cut.gguf"))
    with open(path, "r+b") as handle:
        handle.truncate(200)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        reader(path, config, 16)
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank 4; raise max_lora_rank"):
        reader(write_gguf_lora(adapter, str(tmp_path / "f.gguf")), config, 4)

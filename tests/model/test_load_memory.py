"""A bf16 Hugging Face folder loads without an fp32 (or any second) copy of its
weights: the model is built on the meta device and its parameters are the
checkpoint's tensors. Measured as the peak resident memory a fresh process
adds while loading, against the weights' bytes."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

# Large enough (1.2 GB in bf16) that the weights dominate what loading the tokenizer adds (~50 MB).
SHAPE = dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=49152, max_position_embeddings=2048)

_MEASURE = """
import json, resource, sys, torch
from transformers import AutoConfig
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.packed_linear import PackedLinear
from pagedllm.model.registry import build_model, model_class_for

# Building the model once on the meta device (no memory for weights) first loads the
# modules and compiled kernels it imports, so they do not count as loading's cost.
config = AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    model_class_for(config)(config, max_position=2048)

def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)

before = rss_kib()
checkpoint = load_checkpoint(sys.argv[1], dtype=torch.bfloat16)
model = build_model(checkpoint, 2048, torch.device("cpu"), torch.bfloat16)
# VmHWM, the peak of this address space: ru_maxrss would carry over the forking parent's peak.
peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])
# Parameters, and the weights packed for the packed kernel where this CPU packs them (buffers).
weights = [*model.parameters(), *(m.packed_weight for m in model.modules() if isinstance(m, PackedLinear))]
print(json.dumps({"added_bytes": (peak - before) * 1024, "dtypes": sorted({str(w.dtype) for w in weights}),
                  "param_bytes": sum(w.numel() * w.element_size() for w in weights)}))
"""


@pytest.mark.slow
def test_bf16_folder_loads_within_1_2x_its_weights(tmp_path, smollm_tokenizer):
    config = LlamaConfig(**SHAPE, tie_word_embeddings=False, torch_dtype="bfloat16")
    config.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in _llama_shapes(config).items():
        weights[name] = torch.randn(shape, generator=generator).to(torch.bfloat16)
    file_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    save_file(weights, tmp_path / "model.safetensors")
    del weights

    result = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["dtypes"] == ["torch.bfloat16"]
    assert measured["param_bytes"] == file_bytes
    assert measured["added_bytes"] <= 1.2 * file_bytes, measured


def _llama_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    return shapes

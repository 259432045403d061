"""Each layer's sliding window (``model.shapes.sliding_windows_of``) is the one Hugging Face's
modeling code applies: the attention mask each layer of a tiny random model receives is read
back (a registered attention function that records it, in sdpa's boolean form), and the keys the last query of a
sequence longer than the window may see give that layer's window (all of them: full attention).

One case per supported family and per config field that decides it: Gemma 2/3 ``layer_types``
and Gemma 3's legacy ``sliding_window_pattern``, Mistral (every layer, ``layer_types`` ignored),
Qwen2/3 ``use_sliding_window`` + ``max_window_layers``, SmolLM3's sliding NoPE layers, Phi-3
(every layer when set), Cohere 2's ``layer_types`` (default: every 4th layer full), and Llama / Granite / Gemma 1, which ignore a ``sliding_window`` their
config carries; the mixtures of experts (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, gpt-oss). Llama 4's chunked layers (``model.shapes.layer_attention_of``) are checked by the
keys the last query sees in its chunk.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    Cohere2Config,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GemmaConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    Idefics3Config,
    Llama4TextConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaNextConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2VLConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pagedllm.core.kv_groups import kv_group_layout
from pagedllm.core.kv_managers.chunked_local import ChunkedLocal
from pagedllm.model.registry import SUPPORTED_ARCHITECTURES, VISION_LANGUAGE_ARCHITECTURES
from pagedllm.model.shapes import layer_attention_of, sliding_windows_of
from pagedllm.model.vision.config import decoder_config_of

WINDOW = 4
SEQUENCE = 11  # longer than the window
_COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
               vocab_size=64, num_hidden_layers=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Four experts, two a token (num_experts for Qwen and OLMoE, num_local_experts for the others).
_MOE = dict(_COMMON, num_experts=4, num_local_experts=4, num_experts_per_tok=2)
_MASKS: dict[int, torch.Tensor | None] = {}


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """Records the mask; the output (the queries, in the layout attention returns) is never read."""
    _MASKS[module.layer_idx] = attention_mask
    return query.transpose(1, 2).contiguous(), None


AttentionInterface.register("record_mask", _recording_attention)
AttentionMaskInterface.register("record_mask", sdpa_mask)


def hf_layer_windows(config) -> list[int | None]:
    """The window each layer of Hugging Face's model of ``config`` attends through."""
    _MASKS.clear()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="record_mask").eval()
    with torch.inference_mode():
        model(torch.arange(3, 3 + SEQUENCE)[None])
    windows = []
    for layer in range(config.num_hidden_layers):
        mask = _MASKS[layer]  # None: sdpa's own causal mask, every earlier key
        visible = SEQUENCE if mask is None else int(mask[0, 0, -1].sum())
        windows.append(None if visible == SEQUENCE else visible)
    return windows


CASES = {
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=WINDOW),
    "gemma3": lambda: Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=WINDOW),
    "gemma3-pattern-3": lambda: Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=WINDOW,
                                                 sliding_window_pattern=3),
    "gemma3-layer-types": lambda: Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=WINDOW, layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
        "full_attention"]),
    "gemma": lambda: _with_stray_window(GemmaConfig(**_COMMON, head_dim=16)),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
    "mistral-no-window": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "mistral-layer-types": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW,
                                                 layer_types=["full_attention"] * 6),
    "qwen2-max-window-layers": lambda: Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=2),
    "qwen2-all-sliding": lambda: Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=0),
    "qwen2-off": lambda: Qwen2Config(**_COMMON, use_sliding_window=False, sliding_window=WINDOW,
                                     max_window_layers=2),
    "qwen3-max-window-layers": lambda: Qwen3Config(**_COMMON, head_dim=16, use_sliding_window=True,
                                                   sliding_window=WINDOW, max_window_layers=4),
    "smollm3-sliding-nope-layers": lambda: SmolLM3Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW),
    "smollm3-off": lambda: SmolLM3Config(**_COMMON, use_sliding_window=False, sliding_window=WINDOW),
    "phi3": lambda: Phi3Config(**_COMMON, sliding_window=WINDOW),
    "phi3-no-window": lambda: Phi3Config(**_COMMON, sliding_window=None),
    "llama": lambda: _with_stray_window(LlamaConfig(**_COMMON, head_dim=16)),
    "granite": lambda: _with_stray_window(GraniteConfig(**_COMMON)),
    # Cohere 2's default: every 4th layer full (its legacy sliding_window_pattern), and explicit layer_types.
    "cohere2": lambda: Cohere2Config(**_COMMON, sliding_window=WINDOW),
    "cohere2-layer-types": lambda: Cohere2Config(**_COMMON, sliding_window=WINDOW, layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
        "sliding_attention"]),
    # Llama 4's default: layers chunked where they rotate (no_rope_layers), every 4th full.
    "llama4": lambda: Llama4TextConfig(**_COMMON, head_dim=16, intermediate_size_mlp=64, moe_layers=[],
                                       attention_chunk_size=WINDOW),
    # Mixtures of experts: Mixtral and Qwen3-MoE window every layer when set (Qwen3-MoE's config
    # drops it without use_sliding_window), Qwen2-MoE as Qwen2, OLMoE and Granite-MoE never.
    "mixtral": lambda: MixtralConfig(**_MOE, sliding_window=WINDOW),
    "qwen3-moe": lambda: Qwen3MoeConfig(**_MOE, head_dim=16, use_sliding_window=True, sliding_window=WINDOW),
    "qwen3-moe-off": lambda: Qwen3MoeConfig(**_MOE, head_dim=16, sliding_window=WINDOW),
    "qwen2-moe": lambda: Qwen2MoeConfig(**_MOE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "olmoe": lambda: _with_stray_window(OlmoeConfig(**_MOE)),
    "granitemoe": lambda: _with_stray_window(GraniteMoeConfig(**_MOE)),
    # gpt-oss: layer_types, by default sliding then full, alternating.
    "gpt-oss": lambda: GptOssConfig(**{k: v for k, v in _MOE.items() if k != "num_experts"}, head_dim=16,
                                    sliding_window=WINDOW),
}


def _with_stray_window(config):
    """A config of a family without windows that still carries one (as fine-tunes' may)."""
    config.sliding_window = WINDOW
    return config


@pytest.mark.parametrize("case", CASES)
def test_layer_windows_are_hugging_faces(case):
    config = CASES[case]()
    assert [_keys_seen(layer) for layer in layer_attention_of(config)] == hf_layer_windows(config)
    if config.model_type != "llama4_text":
        assert sliding_windows_of(config) == layer_attention_of(config)


def _keys_seen(layer) -> int | None:
    """The keys the last query of the sequence sees in a layer that attends as ``layer`` says
    (None: every one); a chunked layer's, from its chunk's start."""
    if isinstance(layer, ChunkedLocal):
        last = SEQUENCE - 1
        return last - layer.first_position_read(last) + 1
    return layer


def test_every_supported_family_is_checked():
    """A vision-language family is checked through its decoder: the engine reads the layers'
    windows from its ``text_config`` (``model/vision/config.py``), a family of its own here."""
    checked = {CASES[case]().model_type for case in CASES}
    assert checked == set(SUPPORTED_ARCHITECTURES) - set(VISION_LANGUAGE_ARCHITECTURES)
    vision_language = [Idefics3Config(), LlavaConfig(), LlavaNextConfig(), Gemma3Config()]
    qwen_vl = [config(text_config=CASES["qwen2-max-window-layers"]().to_dict(), tie_word_embeddings=False)
               for config in (Qwen2VLConfig, Qwen2_5_VLConfig)]
    assert {config.model_type for config in vision_language + qwen_vl} == set(VISION_LANGUAGE_ARCHITECTURES)
    assert {config.text_config.model_type for config in vision_language} <= checked
    # Qwen2-VL's decoder config is a type of its own, read with Qwen2's window rule.
    qwen2_windows = sliding_windows_of(CASES["qwen2-max-window-layers"]())
    assert all(sliding_windows_of(decoder_config_of(config)) == qwen2_windows for config in qwen_vl)


@pytest.mark.parametrize("case, expected", [
    ("gemma3", [None, WINDOW, WINDOW, WINDOW, WINDOW, WINDOW]),  # layer 5 full; groups below
    ("qwen2-max-window-layers", [None, None, WINDOW, WINDOW, WINDOW, WINDOW]),
    ("mistral", [WINDOW] * 6),
    ("cohere2", [None, WINDOW, WINDOW, WINDOW, WINDOW, WINDOW]),  # layer 3 full
    ("llama", [None] * 6),
])
def test_kv_groups_of_the_declared_kinds(case, expected):
    """The groups the engine makes from the declared kinds (full first, cut to the smallest kind)."""
    windows = sliding_windows_of(CASES[case]())
    assert sorted(windows, key=lambda w: -1 if w is None else w) == expected
    layout = kv_group_layout(windows)
    full = [layer for layer, window in enumerate(windows) if window is None]
    assert layout.groups[0].window is None or not full
    assert sorted(layer for group in layout.groups if group.window is None for layer in group.layers) == full
    assert kv_group_layout(windows, hybrid=False).num_groups == 1

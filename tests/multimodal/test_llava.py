"""Images in the prompt on a tiny random LLaVA (CLIP tower, MLP projector, the tiny Llama) and
LLaVA-NeXT (the same over anyres tiles): greedy output equals Hugging Face's ``generate``
token for token (one image, two images of different shapes, a text-only prompt, in one
batch); a repeated image+prompt hits the prefix cache; the tower's feature selection
(``vision_feature_layer`` / ``vision_feature_select_strategy``) equals Hugging Face's
``get_image_features``; an unsupported LLaVA is refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.multimodal.tiny_models import hf_greedy, images_of, make_tiny_llava

MAX_TOKENS = 8
PREAMBLE = "You are a careful assistant who looks at pictures and answers in one short sentence. "
CASES = [
    ("USER: <image>\nDescribe it briefly. ASSISTANT:", [1]),
    ("First <image> and then <image>: which is brighter?", [2, (3, (20, 40))]),  # LLaVA-NeXT: a 2x2, a 1x2 grid
    ("A text-only prompt between the others.", []),
    (PREAMBLE + "What is in <image>?", [4]),
]


def _prompt(text: str, spec: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images_of(spec)}} if spec else text


@pytest.mark.slow  # ~10 s each on a 2-core CPU: the tiny model, its processor, Hugging Face's outputs, an engine
@pytest.mark.parametrize(("family", "tower"), [("llava", "clip"), ("llava_next", "clip"), ("llava", "siglip")])
def test_greedy_equals_hugging_face_and_a_repeated_image_hits(tmp_path, tiny_llama, family, tower):
    """SigLIP under "full" (a row per patch, as SigLIP LLaVAs run), CLIP under "default"."""
    config = {"vision_feature_select_strategy": "full"} if tower == "siglip" else {}
    llava = make_tiny_llava(tmp_path, tiny_llama, family, tower, **config)
    hf_class = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration"}[family]
    expected = hf_greedy(llava, hf_class, CASES, MAX_TOKENS)

    llm = LLM(llava, num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([_prompt(text, spec) for text, spec in CASES], params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected

    # (assert_pool_free empties the prefix cache: it comes last.) The same image and text again: every full block hits, the encoder is not run again.
    first = outputs[3]
    hits = llm.stats()["encoder_cache_hits"]
    again = llm.generate(_prompt(*CASES[3]), params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.stats()["encoder_cache_hits"] == hits + 1
    # The same text with another image: only the text blocks before the image hit.
    other = llm.generate(_prompt(CASES[3][0], [5]), params, use_tqdm=False)[0]
    image_offset = first.prompt_token_ids.index(llm.llm_engine.model_config.vision_language_config.image_token_id)
    assert other.num_cached_tokens == image_offset // 16 * 16 > 0
    assert_pool_free(llm)


@pytest.mark.slow  # Hugging Face's LLaVA modules take ~2 s to import: with the test above in the slow tier
@pytest.mark.parametrize("tower", ["clip_vision_model", "siglip_vision_model"])
def test_image_features_equal_hugging_face(tower):
    """The "full" strategy over three hidden states (the input and both ends), quick-GELU projector
    without biases; Hugging Face 5's in-memory names load too (the test above reads the saved layout)."""
    from transformers import LlavaConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    from pagedllm.model.llava import LlavaForConditionalGeneration
    from pagedllm.model.vision.config import decoder_config_of
    from tests.multimodal.tiny_models import VISION

    whole = LlavaConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64),
                        vision_config=dict(VISION, num_hidden_layers=3, model_type=tower), image_token_id=63,
                        vision_feature_select_strategy="full", vision_feature_layer=[-1, 0, 1],
                        projector_hidden_act="quick_gelu", multimodal_projector_bias=False)
    torch.manual_seed(0)
    reference = HFLlava(whole).eval()
    model = LlavaForConditionalGeneration(decoder_config_of(whole))
    model.load_weights({name: tensor.clone() for name, tensor in reference.state_dict().items()})
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = torch.cat(reference.model.get_image_features(pixel_values=pixels).pooler_output)
        got = torch.cat([model.embed_image({"pixel_values": image}) for image in pixels])
    assert got.shape == (2 * (16 + (tower == "clip_vision_model")), 32)  # a row per patch (and CLIP's class row)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("config", "message"), [
    (dict(text_config={"model_type": "gemma"}), "a llava checkpoint with a 'gemma' decoder is not supported"),
    (dict(vision_config={"model_type": "pixtral"}), "'pixtral' vision tower is not supported"),
    (dict(vision_feature_layer=25), "vision_feature_layer 25 is outside the tower's 25 hidden states"),
])
def test_an_unsupported_llava_is_refused_by_name(config, message):
    """Before a tensor is read: the loader asks ``model_class_for``, then builds on the meta device."""
    from transformers import LlavaConfig

    from pagedllm.model.registry import model_class_for
    from pagedllm.model.vision.config import decoder_config_of

    decoder = decoder_config_of(LlavaConfig(**config))
    with pytest.raises(ValueError, match=message), torch.device("meta"):
        model_class_for(decoder)(decoder)

"""Images in the prompt on a tiny random Qwen2-VL and Qwen2.5-VL (their vision transformers at
each image's own resolution, the Qwen2 decoder with multimodal rotary positions): greedy output equals Hugging
Face's ``generate`` token for token with one image, two images of different sizes between
text, and a text-only prompt in one batch, in prefill chunks that split the images;
the same image and text again hits the prefix and encoder caches; a chat ``image_url`` part
goes where the processor's chat template puts it; the prompt's M-RoPE
positions equal Hugging Face's ``get_rope_index``."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.multimodal.test_media import data_url
from tests.multimodal.tiny_models import images_of, make_tiny_qwen2_vl

MAX_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CASES = [
    (f"<|im_start|>user\n{IMAGE}Describe it briefly.<|im_end|>\n<|im_start|>assistant\n", [1]),
    (f"First {IMAGE} and then {IMAGE}: which one is brighter, and why?", [2, (3, (20, 60))]),
    ("A text-only prompt between the others.", []),
    (f"Look at this picture carefully. What is in {IMAGE}? Answer briefly.", [(4, (48, 64))]),
]


HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def hf_inputs(folder: str, text: str, spec: list) -> dict:
    """Hugging Face's model inputs, as ``Qwen2VLProcessor`` builds them: the image processor's
    tensors, each <|image_pad|> repeated for its image's merged patches, the token types."""
    from transformers import AutoImageProcessor, AutoTokenizer

    images = images_of(spec)
    inputs = dict(AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")) if images else {}
    for grid in inputs.get("image_grid_thw", []):
        text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // 4), 1)
    inputs.update(AutoTokenizer.from_pretrained(folder)([text.replace("<|placeholder|>", "<|image_pad|>")],
                                                        return_tensors="pt"))
    inputs.pop("token_type_ids", None)
    if images:
        image_token = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|image_pad|>")
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token).int()
    return inputs


def hf_greedy(folder: str, family: str) -> list[list[int]]:
    import transformers

    model = getattr(transformers, HF_CLASSES[family]).from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    for text, spec in CASES:
        inputs = hf_inputs(folder, text, spec)
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(generated[0, inputs["input_ids"].shape[1]:].tolist())
    return outputs


def _prompt(text: str, spec: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images_of(spec)}} if spec else text


@pytest.mark.slow  # ~10 s each on a 2-core CPU: the tiny model, Hugging Face's outputs, an engine
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_equals_hugging_face_and_a_repeated_image_hits(tmp_path, tiny_llama, family):
    qwen2_vl = make_tiny_qwen2_vl(tmp_path, tiny_llama, family)
    expected = hf_greedy(qwen2_vl, family)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [_prompt(text, spec) for text, spec in CASES]
    # Prefill chunks of 16 tokens: images are split between chunks (and the decodes of the
    # sequences admitted first run beside the later ones' prefill chunks).
    llm = LLM(qwen2_vl, num_kv_blocks=64, block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    # The same image and text again: every full block hits (the cached prefix ends inside the
    # image: the rest of its positions are sliced from the same precomputed table), and the encoder cache.
    hits = llm.stats()["encoder_cache_hits"]
    again = llm.generate(prompts[3], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(outputs[3].prompt_token_ids) - 1) // 16 * 16 > 0
    image_token = llm.llm_engine.model_config.vision_language_config.image_token_id
    image_tokens = [i for i, t in enumerate(outputs[3].prompt_token_ids) if t == image_token]
    assert image_tokens[0] < again.num_cached_tokens <= image_tokens[-1]  # a hit that ends inside the image
    assert list(again.outputs[0].token_ids) == expected[3]
    assert llm.stats()["encoder_cache_hits"] == hits + 1
    # The first case as a chat: the processor's chat template writes the vision markers around the image.
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images_of([1])[0])}},
                                                  {"type": "text", "text": "Describe it briefly."}]}], params, use_tqdm=False)
    assert list(chat[0].outputs[0].token_ids) == expected[0]
    assert_pool_free(llm)
    if family == "qwen2_vl":  # (Qwen2.5-VL's image positions are the same rule)
        _check_prompt_positions(qwen2_vl)


def _check_prompt_positions(folder: str) -> None:
    """Pure data: the positions the runner slices for a prompt with two images equal
    Hugging Face's ``get_rope_index`` (with the test above: it imports Hugging Face's model)."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    from pagedllm.model.qwen2_vl import Qwen2VLForConditionalGeneration
    from pagedllm.multimodal.processing import ImagePromptProcessor

    text, spec = CASES[1]
    config = Qwen2VLConfig.from_pretrained(folder)
    processor = ImagePromptProcessor.for_checkpoint(folder, config.image_token_id, model_type="qwen2_vl")
    token_ids, features = processor.process(text, images_of(spec))
    inputs = hf_inputs(folder, text, spec)
    assert token_ids == inputs["input_ids"][0].tolist()
    model = type("Model", (), {"config": config, "get_vision_position_ids": Qwen2VLModel.get_vision_position_ids})()
    reference, reference_delta = Qwen2VLModel.get_rope_index(model, inputs["input_ids"], inputs["mm_token_type_ids"],
                                                             image_grid_thw=inputs["image_grid_thw"])
    positions, delta = Qwen2VLForConditionalGeneration.mrope_prompt_positions(
        type("Model", (), {"merge": 2})(), len(token_ids), features)
    assert positions.tolist() == reference[:, 0].tolist()
    assert delta == int(reference_delta) < 0


def test_step_positions_slice_the_prompt_table_and_add_the_delta_past_it():
    """The runner's seam, pure data: any span of a prompt (a chunk, the rest after a prefix hit)
    takes its columns of the table computed once; tokens past the prompt take index + delta;
    a step whose tokens' three positions agree gets [tokens]; other sequences keep their indices."""
    from types import SimpleNamespace

    import numpy as np

    from pagedllm.model.mrope import mrope_prompt_positions
    from pagedllm.worker.mrope import MRopePositions

    table, delta = mrope_prompt_positions(10, [(2, 1, 2, 3)])  # text 0-1, a 2x3 image at 2-7, text 8-9
    assert table.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                              [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]] and delta == -3
    seam = MRopePositions(lambda num_tokens, features: (table, delta))
    image = SimpleNamespace(prompt_token_ids=[0] * 10, mm_features=["an image"], mrope=None)
    text = SimpleNamespace(prompt_token_ids=[0] * 4, mm_features=[], mrope=None)
    for sequence in (image, text):
        seam.learn(sequence)
    sequences = {"image": image, "text": text}

    def step(*spans: tuple[str, int, int]) -> np.ndarray:
        order = [SimpleNamespace(sequence_id=name, num_computed_tokens=start, num_scheduled_tokens=count)
                 for name, start, count in spans]
        indices = np.concatenate([np.arange(start, start + count) for _, start, count in spans])
        return seam.step_positions(order, sequences, indices)

    # A decode of each (past the prompt: index + delta) and a chunk from inside the image to past the prompt.
    got = step(("text", 6, 1), ("image", 12, 1), ("image", 4, 8))
    assert got.tolist() == [[6, 9, 2, 2, 2, 2, 5, 6, 7, 8], [6, 9, 2, 3, 3, 3, 5, 6, 7, 8],
                            [6, 9, 4, 2, 3, 4, 5, 6, 7, 8]]
    assert step(("text", 6, 1), ("image", 12, 1)).tolist() == [6, 9]  # all three agree: [tokens]
    assert step(("image", 8, 2)).tolist() == [5, 6]  # the text after the image, from the table
    with pytest.raises(ValueError, match="overlap"):
        mrope_prompt_positions(10, [(2, 1, 2, 3), (6, 1, 1, 2)])

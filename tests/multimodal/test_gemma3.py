"""Images in the prompt on a tiny random Gemma 3 (SigLIP tower, pooling projector, a Gemma 3
decoder with a sliding and a full layer): greedy output equals Hugging Face's ``generate``
token for token (one image, two images between text, a text-only prompt, ``LLM.chat`` with an
``image_url`` part), with each image's tokens attending to each other both ways; whole
prefill, and chunked prefill whose chunks stop before an image and take it whole. A prefix hit
may end inside an image (its blocks are keyed by it); another image under the same text
shares only the text blocks before it."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.multimodal.tiny_models import drawn_image, hf_greedy, images_of, make_tiny_gemma3

pytestmark = pytest.mark.slow  # ~25 s on a 2-core CPU: the tiny model, its processor, Hugging Face's outputs

MAX_TOKENS = 8
IMAGE = "<start_of_image>"  # Gemma 3's placeholder: the processor expands it to boi, 16 image tokens, eoi
PREAMBLE = "You are a careful assistant who looks at pictures and answers in one short sentence. "
QUESTION = PREAMBLE + "What is in it?"
CASES = [
    (f"Look: {IMAGE} ok", [1]),  # 23 tokens: a repeat hits 16 of them, inside the image
    (f"First {IMAGE} and then {IMAGE}: which is brighter?", [2, (3, (20, 40))]),
    ("A text-only prompt between the others.", []),
    (PREAMBLE + f"What is in {IMAGE}?", [4]),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tiny_llama) -> str:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), tiny_llama)


@pytest.fixture(scope="module")
def hf_outputs(gemma3) -> list[list[int]]:
    """Hugging Face's free-running greedy tokens for each case, then for the chat below as
    Hugging Face's processor renders it."""
    from transformers import AutoProcessor

    chat = AutoProcessor.from_pretrained(gemma3).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True)
    return hf_greedy(gemma3, "Gemma3ForConditionalGeneration", [*CASES, (chat, [12])], MAX_TOKENS)


@pytest.fixture(scope="module")
def gemma3_llm(gemma3) -> LLM:
    return LLM(gemma3, num_kv_blocks=64, block_size=16)


def _prompt(text: str, spec: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images_of(spec)}} if spec else text


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked-preempted"])
def test_greedy_equals_hugging_face(gemma3, gemma3_llm, hf_outputs, chunked):
    """A 20-token budget would end chunks inside every image (16 tokens and its markers):
    they stop before it and take it whole instead; a 10-block pool preempts requests
    (recompute), which restart from their cached blocks, inside an image or not."""
    from tests.multimodal.test_media import data_url

    llm = LLM(gemma3, num_kv_blocks=10, block_size=16, max_num_batched_tokens=20) if chunked else gemma3_llm
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([_prompt(text, spec) for text, spec in CASES], params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == hf_outputs[:len(CASES)]
    assert (llm.stats()["num_preemptions"] > 0) == chunked
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(drawn_image(12))}},
                                                  {"type": "text", "text": QUESTION}]}], params)[0]
    assert list(chat.outputs[0].token_ids) == hf_outputs[-1]
    assert_pool_free(llm)


def test_blocks_are_keyed_by_image_content(gemma3_llm):
    """The same image and text again: every full block hits (a hit ending inside the image too:
    its blocks were computed with the whole image), the encoder is not run again, the tokens are
    the same. The same text with another image: only the text blocks before the image hit."""
    llm = gemma3_llm
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    image_token_id = llm.llm_engine.model_config.vision_language_config.image_token_id
    for text, spec in (CASES[0], CASES[3]):
        first = llm.generate(_prompt(text, spec), params, use_tqdm=False)[0]
        hits = llm.stats()["encoder_cache_hits"]
        again = llm.generate(_prompt(text, spec), params, use_tqdm=False)[0]
        assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 > 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert llm.stats()["encoder_cache_hits"] == hits + 1
        image_start = first.prompt_token_ids.index(image_token_id)
        other = llm.generate(_prompt(text, [5]), params, use_tqdm=False)[0]
        assert other.num_cached_tokens == image_start // 16 * 16
        assert other.outputs[0].token_ids != first.outputs[0].token_ids
    short = llm.generate(_prompt(*CASES[0]), params, use_tqdm=False)[0]  # the first case's hit, inside its image
    start = short.prompt_token_ids.index(image_token_id)
    assert start < short.num_cached_tokens == 16 < start + 16
    assert_pool_free(llm)


@pytest.mark.parametrize("engine_args, names", [
    ({"max_num_batched_tokens": 12}, "max_num_batched_tokens"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='auto'"),
], ids=["image-over-budget", "int8-tails"])
def test_an_image_the_engine_cannot_attend_both_ways_is_refused_by_name(gemma3, engine_args, names):
    """An image longer than a step's budget could never be scheduled whole, and an int8 pool's
    full-precision tails attend in query chunks: each such prompt is a ValueError naming the
    setting to change; the engine then serves a text prompt and leaks no block."""
    llm = LLM(gemma3, num_kv_blocks=16, block_size=16, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=names):
        llm.generate(_prompt(*CASES[0]), params, use_tqdm=False)
    assert len(llm.generate(CASES[2][0], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert_pool_free(llm)

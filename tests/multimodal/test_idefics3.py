"""Images in the prompt on a tiny random Idefics3: greedy output equals Hugging Face's
``generate`` token for token (one image, two images between text, a text-only prompt,
in one batch; whole and chunked prefill), and the prefix cache keys blocks by image
content while the encoder cache serves a repeated image."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free
from tests.multimodal.tiny_models import drawn_image, hf_greedy, images_of

pytestmark = pytest.mark.slow  # ~40 s on a 2-core CPU: the tiny model, its processor and Hugging Face's outputs

MAX_TOKENS = 8
PREAMBLE = "You are a careful assistant who looks at pictures and answers in one short sentence. "
CASES = [
    ("Describe <image> briefly.", [1]),
    ("First <image> and then <image>: which is brighter?", [2, (3, (20, 40))]),
    ("A text-only prompt between the others.", []),
    (PREAMBLE + "What is in <image>?", [(4, (60, 30))]),
]


@pytest.fixture(scope="module")
def hf_outputs(idefics3) -> list[list[int]]:
    """Hugging Face's free-running greedy tokens for each case."""
    return hf_greedy(idefics3, "Idefics3ForConditionalGeneration", CASES, MAX_TOKENS)


@pytest.mark.parametrize(("max_num_batched_tokens", "num_kv_blocks"), [(2048, 128), (24, 12)],
                         ids=["whole", "chunked-preempted"])
def test_greedy_equals_hugging_face(idefics3, hf_outputs, max_num_batched_tokens, num_kv_blocks):
    """A 24-token budget splits every image's placeholder run across prefill chunks, and a
    12-block pool preempts requests (recompute), which embed their images again."""
    llm = LLM(idefics3, num_kv_blocks=num_kv_blocks, block_size=16, max_num_batched_tokens=max_num_batched_tokens)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images_of(spec)}} if spec else text
               for text, spec in CASES]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == hf_outputs
    assert (llm.stats()["num_preemptions"] > 0) == (num_kv_blocks == 12)
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def idefics3_llm(idefics3) -> LLM:
    return LLM(idefics3, num_kv_blocks=128, block_size=16)


def test_blocks_are_keyed_by_image_content(idefics3_llm):
    """Same text, another image: only the text blocks before the image hit. The same
    image again: every full block hits, and the encoder is not run again."""
    llm = idefics3_llm
    text = PREAMBLE + "What is in <image>?"
    params = SamplingParams(temperature=0, max_tokens=2)

    def run(seed: int):
        prompt = {"prompt": text, "multi_modal_data": {"image": drawn_image(seed)}}
        return llm.generate(prompt, params, use_tqdm=False)[0]

    first = run(10)
    image_offset = first.prompt_token_ids.index(llm.llm_engine.model_config.vision_language_config.image_token_id)
    assert image_offset > 16
    other = run(11)
    assert other.prompt_token_ids == first.prompt_token_ids  # same tokens: only the image differs
    assert other.num_cached_tokens == image_offset // 16 * 16
    again = run(10)
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    before = llm.stats()
    assert before["encoder_cache_misses"] == 2
    # The same image under other text: no block to share, but its encoder output is cached.
    llm.generate({"prompt": "Tell me about <image>", "multi_modal_data": {"image": drawn_image(10)}}, params,
                 use_tqdm=False)
    after = llm.stats()
    assert after["encoder_cache_misses"] == 2
    assert after["encoder_cache_hits"] == before["encoder_cache_hits"] + 1
    assert_pool_free(llm)


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ({"prompt": "no placeholder", "multi_modal_data": {"image": drawn_image(1)}}, {}, "0 '<image>' placeholders"),
    ({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, {}, "pass PIL images"),
    ({"prompt": "<image>", "multi_modal_data": {"video": [drawn_image(1)]}}, {}, "'image' only"),
    ({"prompt": "<image>", "multi_modal_data": {"image": drawn_image(1)}}, {"truncate_prompt_tokens": 8},
     "truncate_prompt_tokens"),
])
def test_a_bad_image_prompt_is_refused_by_name(idefics3_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        idefics3_llm.generate(prompt, SamplingParams(max_tokens=1, **params), use_tqdm=False)
    assert_pool_free(idefics3_llm)


def test_an_engine_core_process_runs_images_processed_in_front(idefics3, idefics3_llm):
    """The API process runs the processor (its copy, pickled in the core's facts, limits included)
    and sends the tensors as bytes: ``LLM.chat`` with an ``image_url`` part on the core gives the
    in-process engine's greedy tokens for Hugging Face's rendering of the same conversation."""
    from tests.multimodal.test_media import data_url

    picture, question = drawn_image(12), PREAMBLE + "What is in it?"
    hf_text = idefics3_llm.llm_engine.get_image_processor().hf.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = idefics3_llm.generate({"prompt": hf_text, "multi_modal_data": {"image": picture}}, params,
                                     use_tqdm=False)[0]
    llm = LLM(idefics3, engine_process=True, num_kv_blocks=128, block_size=16, limit_mm_per_prompt={"image": 1})
    try:
        out = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                                     {"type": "text", "text": question}]}], params)[0]
        assert out.prompt_token_ids == expected.prompt_token_ids
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert llm.stats()["mm_images_processed"] == 1
        with pytest.raises(ValueError, match="over limit_mm_per_prompt's 1"):
            llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": [drawn_image(1)] * 2}}, params)
        assert_pool_free(llm)
    finally:
        llm.shutdown()
    assert_pool_free(idefics3_llm)

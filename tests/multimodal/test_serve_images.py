"""Images through the server on the tiny Idefics3: the ``openai`` client's chat ``image_url``
(a data URL), the Responses API's ``input_image`` (a file:// URL under the allowed folder)
and the ``anthropic`` client's base64 ``image`` block all give the greedy text of the
in-process ``LLM.generate`` with the same picture and Hugging Face's rendering of the
conversation; a bad image is a 400 saying what to change; the encoder cache and the images
show in /metrics."""

from __future__ import annotations

import base64

import anthropic
import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import free_port
from pagedllm.bench.soak import metric_value
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from tests.conftest import assert_pool_free
from tests.entrypoints.live_server import assert_server_pool_free, uvicorn_thread
from tests.multimodal.test_media import data_url, png_bytes
from tests.multimodal.tiny_models import drawn_image

pytestmark = pytest.mark.slow  # the tiny model, its processor and a live server

MODEL = "tiny-vlm"
MAX_TOKENS = 6
QUESTION = "What is in this picture?"
PICTURE = drawn_image(21)


@pytest.fixture(scope="module")
def served(idefics3, tmp_path_factory):
    """(base URL, the in-process greedy text, the allowed media folder) of a live server whose
    engine first answered the same question in process (the oracle)."""
    media = tmp_path_factory.mktemp("media")
    (media / "picture.png").write_bytes(png_bytes(PICTURE))
    llm = LLM(idefics3, num_kv_blocks=128, block_size=16, limit_mm_per_prompt={"image": 2},
              max_image_pixels=64 * 64, allowed_local_media_path=str(media))
    hf_processor = llm.llm_engine.input_processor.multimodal.hf
    text = hf_processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": QUESTION}]}], add_generation_prompt=True)
    expected = llm.generate({"prompt": text, "multi_modal_data": {"image": PICTURE}},
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert_pool_free(llm)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name=MODEL)
    port = free_port()
    with uvicorn_thread(build_app(state), {"host": "127.0.0.1", "port": port, "log_level": "warning"}):
        yield f"http://127.0.0.1:{port}", expected.outputs[0].text, media
    assert_pool_free(llm)


@pytest.fixture
def server(served):
    yield served
    assert_server_pool_free(served[0])


def test_every_api_sends_an_image_as_in_process(server):
    base, expected, media = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                     {"type": "text", "text": QUESTION}]}])
    assert chat.choices[0].message.content == expected
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": f"file://{media}/picture.png"},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(PICTURE)).decode()}
    message = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120).messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected
    metrics = httpx.get(f"{base}/metrics").text
    # Four requests with the picture (the oracle's included): one encoder run, the rest from the cache.
    assert metric_value(metrics, "pagedllm:mm_images_processed_total") == 4
    assert metric_value(metrics, "pagedllm:encoder_cache_misses_total") == 1
    assert metric_value(metrics, "pagedllm:encoder_cache_hits_total") == 3


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(("parts", "says"), [
    ([_image("data:image/png;base64," + base64.b64encode(b"not a picture").decode())], "cannot be decoded"),
    ([_image(data_url(drawn_image(1, (80, 80))))], "over max_image_pixels (4096)"),
    ([_image(data_url(PICTURE))] * 3, "the prompt has 3 images, over limit_mm_per_prompt's 2"),
    ([_image("file:///etc/hostname")], "under the allowed local media path"),
    ([_image("https://example.com/cat.png")], "--allowed-media-domains"),
], ids=["undecodable", "too-large", "too-many", "outside-media-path", "host-not-allowed"])
def test_a_bad_image_is_a_400_saying_what_to_change(server, parts, says):
    base = server[0]
    answer = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages" and says in error["message"], error

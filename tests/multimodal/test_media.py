"""Images named by URL (data, file:// under the allowed folder, http(s) from allowed hosts,
within the byte and pixel limits), and processed images as bytes across the engine-core
boundary: no model, fast."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import msgspec
import pytest
import torch
from PIL import Image

from pagedllm.config.multimodal import MultiModalConfig
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedllm.multimodal.media import load_image
from pagedllm.multimodal.wire import WireFeature, features_from_wire, features_to_wire
from tests.multimodal.tiny_models import drawn_image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def test_a_data_url_decodes_to_the_same_pixels():
    image = drawn_image(1)
    assert load_image(data_url(image), MultiModalConfig()).tobytes() == image.tobytes()


@pytest.mark.parametrize(("url", "config", "says"), [
    ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), {}, "cannot be decoded"),
    ("data:image/png;base64,%%%", {}, "base64 does not decode"),
    ("data:text/plain;base64,aGk=", {}, "data:image/<format>;base64"),
    ("ftp://host/cat.png", {}, "scheme 'ftp' is not supported"),
    ("http://example.com/cat.png", {}, "--allowed-media-domains"),
    ("file:///etc/hostname", {}, "--allowed-local-media-path"),
    (None, {"max_image_pixels": 100}, "over max_image_pixels (100)"),
    (None, {"max_media_bytes": 10}, "over max_media_bytes (10)"),
], ids=["undecodable", "bad-base64", "not-an-image-url", "scheme", "host", "no-local-path", "pixels", "bytes"])
def test_a_bad_image_url_says_what_to_change(url, config, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        load_image(url or data_url(drawn_image(2)), MultiModalConfig(**config))


def test_local_files_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    image = drawn_image(3)
    (allowed / "cat.png").write_bytes(png_bytes(image))
    (tmp_path / "secret.png").write_bytes(png_bytes(image))
    config = MultiModalConfig(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed}/cat.png", config).tobytes() == image.tobytes()
    for outside in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png"):
        with pytest.raises(ValueError, match="under the allowed local media path"):
            load_image(outside, config)


class _Pictures(http.server.BaseHTTPRequestHandler):
    """/cat.png: a picture; /slow.png: no answer for 2 s; /hop.png: a redirect to /cat.png."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(2)  # then nothing: the client has given up
            return
        if self.path == "/hop.png":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = png_bytes(drawn_image(4))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def picture_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_downloads_from_allowed_hosts_within_the_time_and_size_limits(picture_server):
    config = MultiModalConfig(allowed_media_domains="localhost, 127.0.0.1", media_fetch_timeout_s=0.5)
    assert load_image(f"{picture_server}/cat.png", config).tobytes() == drawn_image(4).tobytes()
    with pytest.raises(ValueError, match="could not be fetched within 0.5 s"):
        load_image(f"{picture_server}/slow.png", config)
    with pytest.raises(ValueError, match="could not be fetched"):  # a redirect could leave the allowed hosts
        load_image(f"{picture_server}/hop.png", config)
    with pytest.raises(ValueError, match="over max_media_bytes"):
        load_image(f"{picture_server}/cat.png", MultiModalConfig(allowed_media_domains="127.0.0.1",
                                                                 max_media_bytes=64))


def test_processed_images_cross_the_wire_as_bytes():
    data = {"pixel_values": torch.randn(2, 3, 4, 4), "pixel_attention_mask": torch.rand(2, 4, 4) > 0.5,
            "half": torch.randn(3).to(torch.bfloat16)}
    feature = MultiModalFeature("image", "abc", PlaceholderRange(5, 9), 7, 8, data, attends_both_ways=True)
    encoded = msgspec.msgpack.encode(features_to_wire([feature]))
    back, = features_from_wire(msgspec.msgpack.decode(encoded, type=list[WireFeature]))
    assert (back.modality, back.identifier, back.placeholder, back.embed_token_id, back.num_embeds,
            back.attends_both_ways) == ("image", "abc", PlaceholderRange(5, 9), 7, 8, True)
    for name, tensor in data.items():
        assert back.data[name].dtype == tensor.dtype and torch.equal(back.data[name], tensor)


def test_the_command_line_takes_vllms_multimodal_flags():
    import argparse

    from pagedllm.config.engine import EngineConfig
    from pagedllm.entrypoints.engine_args import add_engine_args, engine_flags_from_args, engine_options_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", "/srv/media",
                              "--allowed-media-domains", "cdn.example.com"])
    config = EngineConfig.from_options(**{**engine_options_from_args(args), "model": "m"}).multimodal
    assert (config.limit("image"), config.allowed_local_media_path, config.media_domains) == \
        (2, "/srv/media", frozenset({"cdn.example.com"}))
    assert engine_flags_from_args(args)[:2] == ["--limit-mm-per-prompt", '{"image": 2}']  # to a child server


@pytest.mark.parametrize(("options", "says"), [
    ({"limit_mm_per_prompt": {"video": 1}}, "unknown modalities"),
    ({"limit_mm_per_prompt": {"image": -1}}, "integer >= 0"),
    ({"max_image_pixels": 0}, "max_image_pixels must be"),
])
def test_bad_multimodal_options_are_refused(options, says):
    with pytest.raises(ValueError, match=says):
        MultiModalConfig(**options)

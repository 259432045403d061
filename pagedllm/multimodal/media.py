"""Images named by URL in API requests: ``data:image/...;base64,`` URLs, ``file://``
paths only under ``allowed_local_media_path``, and ``http(s)://`` URLs only for the
hosts of ``allowed_media_domains`` (a server must not fetch whatever a client names),
each within ``max_media_bytes`` and (downloads) ``media_fetch_timeout_s``.

Every refusal is a ``ValueError`` saying what to change, which the server turns
into a 400 naming the request field."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from pagedllm.config.multimodal import MultiModalConfig


def decode_image(data: bytes, config: MultiModalConfig) -> Image.Image:
    """The decoded picture, within ``max_media_bytes`` and ``max_image_pixels``."""
    if len(data) > config.max_media_bytes:
        raise ValueError(f"the image is {len(data)} bytes, over max_media_bytes ({config.max_media_bytes}); "
                         "send a smaller image")
    try:
        image = Image.open(io.BytesIO(data))
        pixels = image.size[0] * image.size[1]  # read from the header: checked before decoding the pixels
        if pixels > config.max_image_pixels:
            raise ValueError(f"the image is {image.size[0]}x{image.size[1]} = {pixels} pixels, over "
                             f"max_image_pixels ({config.max_image_pixels}); send a smaller image")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image cannot be decoded ({exc}); send a PNG, JPEG, WebP or GIF image") from exc
    return image


def load_image(url: str, config: MultiModalConfig) -> Image.Image:
    """The image ``url`` names (data, file or http(s) URL), by the rules above."""
    if not isinstance(url, str) or not url:
        raise ValueError("the image URL must be a non-empty string")
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return decode_image(_data_url_bytes(url), config)
    if scheme == "file":
        return decode_image(_local_bytes(url, config), config)
    if scheme in ("http", "https"):
        return decode_image(_download(url, config), config)
    raise ValueError(f"image URL scheme {scheme or url[:16]!r} is not supported; "
                     "send a data:image/...;base64, URL, an http(s) URL or a file:// path")


def _data_url_bytes(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise ValueError("a data URL must be data:image/<format>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data URL's base64 does not decode ({exc})") from exc


def _local_bytes(url: str, config: MultiModalConfig) -> bytes:
    if config.allowed_local_media_path is None:
        raise ValueError("file:// image URLs are refused: this server was started without "
                         "--allowed-local-media-path; send a data URL instead")
    root = Path(config.allowed_local_media_path).resolve()
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()  # symlinks and .. resolved
    if not path.is_relative_to(root):
        raise ValueError(f"file:// image URLs must name a file under the allowed local media path ({root})")
    try:
        with path.open("rb") as file:
            return file.read(config.max_media_bytes + 1)
    except OSError as exc:
        raise ValueError(f"the image file cannot be read ({exc.strerror})") from exc


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead to a host outside ``allowed_media_domains``: it fails the fetch."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def _download(url: str, config: MultiModalConfig) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in config.media_domains:
        raise ValueError(f"image URLs of host {host!r} are not fetched; the server fetches only hosts named by "
                         "--allowed-media-domains (send a data URL instead)")
    try:
        with _NO_REDIRECTS.open(url, timeout=config.media_fetch_timeout_s) as response:
            return response.read(config.max_media_bytes + 1)
    except (urllib.error.URLError, OSError) as exc:  # HTTP errors, refused connections and timeouts
        raise ValueError(f"the image URL could not be fetched within {config.media_fetch_timeout_s} s ({exc})") \
            from exc

"""Where an image comes from: the bytes behind an OpenAI `image_url` content part, with limits.

OpenAI clients send images as content parts `{"type": "image_url", "image_url": {"url": ...,
"detail": ...}}`. The url is one of:
- a `data:` URL (`data:image/png;base64,...`): always accepted;
- an `http(s)` URL: fetched only when the server allows it (`allow_urls`, off by default: a
  server that fetches any URL its clients name can be pointed at the internal network), with a
  timeout, a byte limit and a redirect limit;
- a local file (`file:///path` or a bare path): only under `media_dir`, resolved first, so `..`
  and symlinks that leave the folder are refused.

Every refusal is an `ImageError` whose message says what was wrong, the value, and how to fix it;
the server turns it into a 400. Decoding the bytes and the pixel limit live in
`vision/processor.decode_image`.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import pathlib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from dsv41_jax.vision.processor import ImageError, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, decode_image

DETAILS = ("auto", "low", "high")


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What a server accepts; each breach is refused naming the limit and its flag."""

    max_images: int = 8  # per request (--max-images-per-request)
    max_bytes: int = MAX_IMAGE_BYTES  # per image, encoded (--max-image-bytes)
    max_pixels: int = MAX_IMAGE_PIXELS  # per image, decoded (--max-image-pixels)
    allow_urls: bool = False  # fetch http(s) URLs (--allow-image-urls)
    media_dir: str | None = None  # local files only under this folder (--allowed-media-dir)
    url_timeout: float = 10.0  # seconds per fetch
    max_redirects: int = 3

    def __post_init__(self):
        for name in ("max_images", "max_bytes", "max_pixels", "max_redirects"):
            if int(getattr(self, name)) < (0 if name == "max_redirects" else 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.url_timeout <= 0:
            raise ValueError(f"url_timeout must be > 0 seconds, got {self.url_timeout!r}")


def part_url(part: Mapping, where: str) -> tuple[str, str | None]:
    """(url, detail) of an image content part in any of the shapes clients send."""
    kind = part.get("type")
    value = part.get("image_url") if kind in ("image_url", "input_image") else part.get("image")
    if kind == "input_image" and isinstance(value, str):  # the Responses API's flat form
        return value, part.get("detail")
    if isinstance(value, Mapping):
        url, detail = value.get("url"), value.get("detail")
    else:
        url, detail = value, part.get("detail")
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}: an image part needs a url string, e.g. {{'type': 'image_url', 'image_url': "
                         "{'url': 'data:image/png;base64,...'}}")
    if detail is not None and detail not in DETAILS:
        raise ImageError(f"{where}: detail {detail!r} is not one of {list(DETAILS)}")
    return url, detail


def _data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ImageError(f"{where}: a data URL is 'data:<mime>;base64,<payload>', got {url[:40]!r}...")
    if not head.endswith(";base64"):
        raise ImageError(f"{where}: only base64 data URLs are accepted (got {head!r}); encode the image as base64")
    if len(payload) > (limits.max_bytes * 4) // 3 + 4:
        raise ImageError(f"{where}: image is over the {limits.max_bytes}-byte limit (--max-image-bytes); send a "
                         "smaller file")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data URL's payload is not valid base64 ({e})") from None


class _Redirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, limit: int):
        self.max_redirections = limit  # urllib's own counter: one more raises the redirect as an HTTPError


def _fetch(url: str, where: str, limits: ImageLimits) -> bytes:
    if not limits.allow_urls:
        raise ImageError(f"{where}: this server does not fetch image URLs ({url[:60]!r}); send the image as a data "
                         "URL, or start the server with --allow-image-urls")
    opener = urllib.request.build_opener(_Redirects(limits.max_redirects))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "dsv41-jax"}),
                         timeout=limits.url_timeout) as r:
            size = r.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > limits.max_bytes:
                raise ImageError(f"{where}: {url[:60]!r} is {size} bytes, over the {limits.max_bytes}-byte limit "
                                 "(--max-image-bytes)")
            data = r.read(limits.max_bytes + 1)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        # a redirect that reaches the caller is one past urllib's limit (or a loop it detected)
        why = f"more than {limits.max_redirects} redirects" if 300 <= e.code < 400 else f"HTTP {e.code}"
        raise ImageError(f"{where}: fetching {url[:60]!r} failed: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"{where}: fetching {url[:60]!r} failed: {getattr(e, 'reason', e)} "
                         f"(timeout {limits.url_timeout} s)") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: {url[:60]!r} is over the {limits.max_bytes}-byte limit (--max-image-bytes)")
    return data


def _local(path: str, where: str, limits: ImageLimits) -> bytes:
    if limits.media_dir is None:
        raise ImageError(f"{where}: this server does not read local files ({path[:60]!r}); send a data URL, or "
                         "start the server with --allowed-media-dir DIR")
    root = pathlib.Path(limits.media_dir).resolve()
    if ".." in pathlib.PurePath(path).parts:
        raise ImageError(f"{where}: {path!r} contains '..'; name a file under the allowed media folder")
    target = (root / path).resolve()  # an absolute path replaces root; resolve() follows symlinks
    if target != root and root not in target.parents:
        raise ImageError(f"{where}: {path!r} is outside the allowed media folder {str(root)!r} "
                         "(--allowed-media-dir)")
    try:
        size = target.stat().st_size
        if size > limits.max_bytes:
            raise ImageError(f"{where}: {path!r} is {size} bytes, over the {limits.max_bytes}-byte limit "
                             "(--max-image-bytes)")
        return target.read_bytes()
    except ImageError:
        raise
    except OSError as e:
        raise ImageError(f"{where}: cannot read {path!r}: {e.strerror}") from None


def image_bytes(part: Mapping, where: str, limits: ImageLimits) -> bytes:
    """The encoded bytes of one image content part (not yet decoded)."""
    url, _ = part_url(part, where)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, where, limits)
    elif scheme in ("http", "https"):
        data = _fetch(url, where, limits)
    elif scheme == "file":
        data = _local(urllib.request.url2pathname(urllib.parse.urlsplit(url).path), where, limits)
    elif scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        data = _local(url, where, limits)
    else:
        raise ImageError(f"{where}: image URL scheme {scheme!r} is not served; use a data:, http(s): or file: URL")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: image is {len(data)} bytes, over the {limits.max_bytes}-byte limit "
                         "(--max-image-bytes)")
    return data


def load_images(parts, limits: ImageLimits, where: str = "messages"):
    """Decoded RGB images for a prompt's image parts (in prompt order), within `limits`."""
    if len(parts) > limits.max_images:
        raise ImageError(f"{where}: {len(parts)} images, over the limit of {limits.max_images} per request "
                         "(--max-images-per-request)")
    out = []
    for k, part in enumerate(parts):
        at = f"{where}: image {k}"
        data = image_bytes(part, at, limits)
        try:
            out.append(decode_image(data, max_bytes=limits.max_bytes, max_pixels=limits.max_pixels))
        except ImageError as e:
            raise ImageError(f"{at}: {e}") from None
    return out

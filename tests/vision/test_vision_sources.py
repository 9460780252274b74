"""Image content parts -> bytes -> RGB images, as the server reads them (dsv41_jax/vision/sources.py): data URLs in
every format clients send, http(s) URLs from a real local server (off by default, limits on size and redirects),
local files only under the allowed folder, and a clear ImageError for every hostile input."""
import base64
import http.server
import io
import os
import threading

import pytest
from PIL import Image

from dsv41_jax.vision.processor import ImageError
from dsv41_jax.vision.sources import ImageLimits, image_bytes, load_images, part_url


def encoded(fmt: str, color=(200, 10, 30), size=(7, 5), **kw) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt, **kw)
    return buf.getvalue()


def data_part(data: bytes, mime="image/png", detail=None) -> dict:
    url = {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}
    if detail is not None:
        url["detail"] = detail
    return {"type": "image_url", "image_url": url}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_in_each_format(fmt):
    img, = load_images([data_part(encoded(fmt, quality=100) if fmt != "PNG" else encoded(fmt))], ImageLimits())
    assert img.mode == "RGB" and img.size == (7, 5)
    r, g, b = img.getpixel((3, 2))
    assert abs(r - 200) < 12 and g < 30 and abs(b - 30) < 20


def test_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    img, = load_images([data_part(buf.getvalue(), "image/gif")], ImageLimits())
    assert img.getpixel((0, 0)) == (255, 0, 0)


def test_part_shapes_and_detail():
    url = "data:image/png;base64,AAAA"
    assert part_url({"type": "image_url", "image_url": {"url": url, "detail": "low"}}, "m") == (url, "low")
    assert part_url({"type": "image_url", "image_url": url}, "m") == (url, None)
    assert part_url({"type": "input_image", "image_url": url, "detail": "high"}, "m") == (url, "high")
    with pytest.raises(ImageError, match="detail 'tiny' is not one of"):
        part_url({"type": "image_url", "image_url": {"url": url, "detail": "tiny"}}, "m")
    with pytest.raises(ImageError, match="needs a url string"):
        part_url({"type": "image_url", "image_url": {}}, "m")


@pytest.mark.parametrize(("part", "needle"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "only base64 data URLs"),
    (data_part(b"this is not an image"), "cannot be decoded"),
    (data_part(encoded("PNG", size=(64, 64))[:60]), "cannot be decoded"),  # truncated
    ({"type": "image_url", "image_url": {"url": "ftp://host/x.png"}}, "scheme 'ftp' is not served"),
    ({"type": "image_url", "image_url": {"url": "https://127.0.0.1:9/x.png"}}, "--allow-image-urls"),
    ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "--allowed-media-dir"),
])
def test_hostile_inputs_are_clear_errors(part, needle):
    with pytest.raises(ImageError, match=needle):
        load_images([part], ImageLimits())


def test_limits_name_their_flag():
    png = encoded("PNG", size=(100, 100))
    with pytest.raises(ImageError, match="over the limit of 1 per request.*--max-images-per-request"):
        load_images([data_part(png)] * 2, ImageLimits(max_images=1))
    with pytest.raises(ImageError, match="--max-image-bytes"):
        load_images([data_part(png)], ImageLimits(max_bytes=len(png) - 1))
    with pytest.raises(ImageError, match="10000 pixels, over the 5000-pixel limit"):
        load_images([data_part(png)], ImageLimits(max_pixels=5000))
    with pytest.raises(ValueError, match="max_images must be a positive integer"):
        ImageLimits(max_images=0)


def test_decompression_bomb_is_refused_before_decoding():
    bomb = encoded("PNG", color=(0, 0, 0), size=(20000, 20000))  # 400 M pixels, a few hundred kB compressed
    with pytest.raises(ImageError, match="pixel"):
        load_images([data_part(bomb)], ImageLimits())


@pytest.fixture
def web(tmp_path):
    png = encoded("PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/img.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            elif self.path.startswith("/loop"):
                self.send_response(302)
                self.send_header("Location", f"/loop{len(self.path)}")
                self.end_headers()
            elif self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", "/img.png")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    server.shutdown()


def url_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_urls_fetched_only_when_allowed(web):
    base, png = web
    allowed = ImageLimits(allow_urls=True, url_timeout=5)
    with pytest.raises(ImageError, match="--allow-image-urls"):
        image_bytes(url_part(base + "/img.png"), "m", ImageLimits())
    assert image_bytes(url_part(base + "/img.png"), "m", allowed) == png
    assert image_bytes(url_part(base + "/hop"), "m", allowed) == png  # one redirect is fine
    with pytest.raises(ImageError, match="more than 3 redirects"):
        image_bytes(url_part(base + "/loop"), "m", allowed)
    with pytest.raises(ImageError, match="HTTP 404"):
        image_bytes(url_part(base + "/missing.png"), "m", allowed)
    with pytest.raises(ImageError, match="--max-image-bytes"):
        image_bytes(url_part(base + "/img.png"), "m", ImageLimits(allow_urls=True, max_bytes=len(png) - 1))


def test_local_files_only_under_the_media_folder(tmp_path):
    media, outside = tmp_path / "media", tmp_path / "secret"
    (media / "sub").mkdir(parents=True)
    outside.mkdir()
    png = encoded("PNG")
    (media / "sub" / "a.png").write_bytes(png)
    (outside / "b.png").write_bytes(png)
    os.symlink(outside / "b.png", media / "link.png")
    limits = ImageLimits(media_dir=str(media))
    assert image_bytes(url_part("sub/a.png"), "m", limits) == png
    assert image_bytes(url_part(str(media / "sub" / "a.png")), "m", limits) == png
    assert image_bytes(url_part((media / "sub" / "a.png").as_uri()), "m", limits) == png
    for path, needle in (("sub/../../secret/b.png", "contains '..'"), ("link.png", "outside the allowed media folder"),
                         (str(outside / "b.png"), "outside the allowed media folder"),
                         ("sub/none.png", "cannot read")):
        with pytest.raises(ImageError, match=needle):
            image_bytes(url_part(path), "m", limits)

"""The image processor against the reference's own outputs (tests/data/vision_processor_ref.json:
`inference/image_processor.py` run once outside this repo on 46 images: very wide, very tall,
tiny, huge, palette/RGBA/grey, three configs), plus decoding and limits on real files."""
import hashlib
import json
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from dsv41_jax.config import ModelConfig
from dsv41_jax.vision import processor
from dsv41_jax.vision.merge import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, span_types

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
REF = json.loads((DATA / "vision_processor_ref.json").read_text())
REF_FULL = np.load(DATA / "vision_processor_ref.npz")


def pattern(w: int, h: int, mode: str) -> Image.Image:
    """The deterministic test image of the reference run (integer arithmetic, no RNG)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.int64)
    ch = [(x * 73 + y * 151 + c * 29 + (x * y) % 97 + (x // 7) * (y // 5) * 3) % 256 for c in range(3)]
    a = np.stack(ch, -1).astype(np.uint8)
    img = Image.fromarray(a, "RGB")
    if mode == "RGBA":
        alpha = ((x * 5 + y * 11) % 256).astype(np.uint8)
        img = Image.fromarray(np.concatenate([a, alpha[..., None]], -1), "RGBA")
    elif mode != "RGB":
        img = img.convert(mode)
    return img


def _cfg(name):
    return SimpleNamespace(**REF["provenance"]["configs"][name])


def _marks(case):  # building the multi-megapixel test images takes seconds each on 2 cores
    return [pytest.mark.slow] if case["width"] * case["height"] > 1_500_000 else []


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c), id=c["name"]) for c in REF["cases"]])
def test_patches_grids_and_token_counts_equal_the_reference(case):
    cfg = _cfg(case["config"])
    patches, grid = processor.image_patches(pattern(case["width"], case["height"], case["mode"]), cfg)
    assert (grid.n_vit_h, grid.n_vit_w, grid.n_llm_h, grid.n_llm_w) == (case["n_vit_h"], case["n_vit_w"], case["n_llm_h"], case["n_llm_w"])
    assert (grid.height, grid.width) == (case["best_height"], case["best_width"])
    assert grid.n_tokens == case["n_tokens"] <= cfg.vision_max_n_token
    types = span_types(grid.n_llm_h, grid.n_llm_w)
    assert hashlib.sha256(types.astype("<i8").tobytes()).hexdigest() == case["token_types_sha256"]
    assert list(patches.shape) == case["patches_shape"]
    bits = patches.view(np.uint16)
    if case["name"] in REF_FULL:
        np.testing.assert_array_equal(bits, REF_FULL[case["name"]])
    assert hashlib.sha256(bits.astype("<u2").tobytes()).hexdigest() == case["patches_sha256"]


def test_span_layout():
    assert span_types(2, 3).tolist() == [IMAGE_START] + ([IMAGE] * 3 + [IMAGE_NEW_LINE]) * 2 + [IMAGE_END]


def test_values_are_normalised_and_padding_is_grey():
    cfg = _cfg("tiny")
    img = Image.new("RGB", (41, 9), (255, 0, 127))  # planned 44 x 12: letterboxed top and bottom
    patches, grid = processor.image_patches(img, cfg)
    p = cfg.vision_patch_size
    pixels = patches.astype(np.float32).reshape(grid.n_vit_h, grid.n_vit_w, 3, p, p).transpose(0, 3, 1, 4, 2)
    pixels = pixels.reshape(grid.height, grid.width, 3)  # undo the row-major patchify
    grey = np.float32((np.float32(127) / np.float32(255) - np.float32(0.5)) / np.float32(0.5))
    grey = float(np.asarray(grey).astype(patches.dtype).astype(np.float32))
    assert np.all(pixels[0] == grey) and np.all(pixels[-1] == grey)  # padding rows
    middle = pixels[grid.height // 2, grid.width // 2]
    assert middle.tolist() == [1.0, -1.0, grey]  # 255 -> 1, 0 -> -1, 127 -> the grey value
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0


def test_files_decode_like_arrays(tmp_path):
    cfg = _cfg("tiny")
    for name in ("photo_small.png", "photo_small.jpg", "wide_palette.png"):
        data = (DATA / name).read_bytes()
        patches, grid = processor.image_patches(processor.decode_image(data), cfg)
        with Image.open(DATA / name) as im:
            want, _ = processor.image_patches(im.convert("RGB"), cfg)
        np.testing.assert_array_equal(patches.view(np.uint16), want.view(np.uint16))
        assert grid.n_tokens <= cfg.vision_max_n_token


def test_bad_images_are_refused_clearly():
    with pytest.raises(processor.ImageError, match="cannot be decoded"):
        processor.decode_image(b"not an image at all")
    png = (DATA / "photo_small.png").read_bytes()
    with pytest.raises(processor.ImageError, match="cannot be decoded"):
        processor.decode_image(png[: len(png) // 2])
    with pytest.raises(processor.ImageError, match="byte limit"):
        processor.decode_image(png, max_bytes=100)
    with pytest.raises(processor.ImageError, match="pixel limit"):
        processor.decode_image(png, max_pixels=10)


def test_expand_prompt_places_spans_at_the_placeholders():
    cfg = ModelConfig.tiny(vision_n_layers=1, vision_dim=32, vision_n_heads=2, vision_inter_dim=48, vision_patch_size=4,
                           vision_max_n_token=64, vision_min_pixels=256, image_token_id=511)
    img = pattern(30, 9, "RGB")
    tokens, types, inputs = processor.expand_prompt([5, 511, 7, 511], [img, (DATA / "photo_small.png").read_bytes()], cfg)
    assert len(tokens) == len(types) and len(inputs) == 2
    assert inputs[0].start == 1 and types[0] == TEXT and types[1] == IMAGE_START
    end0 = inputs[0].start + processor.plan_grid(30, 9, cfg).n_tokens
    assert types[end0 - 1] == IMAGE_END and tokens[end0] == 7 and inputs[1].start == end0 + 1
    assert all(t == 511 for t, k in zip(tokens, types) if k != TEXT)
    with pytest.raises(processor.ImageError, match="2 image placeholders but 1 images"):
        processor.expand_prompt([511, 511], [img], cfg)
    with pytest.raises(processor.ImageError, match="no vision tower"):
        processor.expand_prompt([511], [img], cfg.language_model_only())

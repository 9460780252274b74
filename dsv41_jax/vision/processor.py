"""Pixels -> ViT patches and the image's span in the prompt, by the rules of the reference's
`inference/image_processor.py` (docs/VISION.md "Image processor"; checked against its outputs in
tests/vision/test_vision_processor.py):

1. aspect clamp: with `vision_max_wh_ratio` set, a wider image is planned as height x ratio wide;
2. minimum pixel count: smaller images are planned scaled up to `vision_min_pixels` (int-truncated);
3. rounding: each side rounded up to a multiple of the patch size;
4. token budget: if START + rows of (IMAGE x n_llm_w + NEWLINE) + END exceeds `vision_max_n_token`,
   the largest aspect-preserving grid that fits is solved for (one column / one row for extreme
   aspect ratios);
5. the decoded RGB image is letterboxed into that size with grey (127) padding (`ImageOps.pad`),
   or stretched when the aspect clamp applies to it;
6. values p / 255, then (x - 0.5) / 0.5 in F32, then BF16; patches row-major over the grid,
   each flattened (channel, row, column).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dsv41_jax.vision.merge import ImageInput, llm_grid, num_image_tokens, span_types, TEXT

GREY = (127, 127, 127)
MAX_IMAGE_BYTES = 32 << 20  # decoded-file limit before Pillow sees the bytes
MAX_IMAGE_PIXELS = 64 << 20  # refuse decompression bombs before converting


class ImageError(ValueError):
    """An image that cannot be read or is outside the limits; the message says which and how to fix it."""


@dataclass(frozen=True)
class ImageGrid:
    """Where an image lands: its pixel size after planning and its patch and token grids."""

    height: int
    width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def n_tokens(self) -> int:
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


def _fit_budget(height: int, width: int, p: int, r: int, budget: int) -> tuple[int, int]:
    """Pixel size of the largest aspect-preserving grid within `budget` span tokens.

    With n_w columns the span costs about aspect * n_w * (n_w + 1) + 2 tokens; n_w solves the
    quadratic. A grid narrower (lower) than one cell degenerates to one column (row).
    """
    aspect = height / width
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    cell = p * r
    if cols < 1.0:
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, cfg) -> ImageGrid:
    """The grid an image of this original size gets under `cfg`'s vision_* fields."""
    p, r, budget = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    if width <= 0 or height <= 0:
        raise ImageError(f"image size {width} x {height} is empty; send an image with at least one pixel")
    w, h = width, height
    if cfg.vision_max_wh_ratio is not None and w > h * cfg.vision_max_wh_ratio:
        w = h * cfg.vision_max_wh_ratio
    if w * h < cfg.vision_min_pixels:
        up = (cfg.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    n_llm_h, n_llm_w = llm_grid(best_h // p, best_w // p, r)
    if num_image_tokens(n_llm_h, n_llm_w) > budget:
        best_h, best_w = _fit_budget(h, w, p, r, budget)
        n_llm_h, n_llm_w = llm_grid(best_h // p, best_w // p, r)
        if num_image_tokens(n_llm_h, n_llm_w) > budget:  # cannot happen for budget >= 4; guard the invariant
            raise ImageError(f"image {width} x {height} cannot fit vision_max_n_token={budget}")
    return ImageGrid(best_h, best_w, best_h // p, best_w // p, n_llm_h, n_llm_w)


def decode_image(data: bytes, *, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS):
    """Encoded image bytes (PNG, JPEG, WebP, GIF, ...) -> an RGB PIL image, with clear refusals."""
    if len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the {max_bytes}-byte limit; send a smaller file")
    try:
        with Image.open(io.BytesIO(data)) as src:
            if src.width * src.height > max_pixels:
                raise ImageError(f"image is {src.width} x {src.height} = {src.width * src.height} pixels, over the "
                                 f"{max_pixels}-pixel limit; downscale it first")
            return src.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image data cannot be decoded ({type(e).__name__}: {e}); send PNG, JPEG, WebP or GIF bytes") from None


def image_patches(image, cfg) -> tuple[np.ndarray, ImageGrid]:
    """A PIL image -> (patches bf16 [n_vit_h * n_vit_w, 3, p, p], grid)."""
    image = image.convert("RGB")
    grid = plan_grid(image.width, image.height, cfg)
    size = (grid.width, grid.height)
    if cfg.vision_max_wh_ratio is not None and image.width >= cfg.vision_max_wh_ratio * image.height:
        image = image.resize(size)  # the clamped aspect: stretched, not letterboxed
    else:
        image = ImageOps.pad(image, size, color=GREY)
    x = np.asarray(image, dtype=np.float32) / np.float32(255)
    x = ((x - np.float32(0.5)) / np.float32(0.5)).astype(ml_dtypes.bfloat16)  # [H, W, 3]
    p = cfg.vision_patch_size
    x = x.reshape(grid.n_vit_h, p, grid.n_vit_w, p, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(x.reshape(grid.n_vit_h * grid.n_vit_w, 3, p, p)), grid


def expand_prompt(token_ids, images, cfg) -> tuple[list[int], list[int], list[ImageInput]]:
    """Replace each `image_token_id` placeholder of a tokenized prompt by its image's span.

    images: PIL images or encoded bytes, one per placeholder in order. Returns (tokens, token
    types, image inputs); span positions carry `image_token_id`, text positions type TEXT.
    """
    if not cfg.vision_enabled and images:
        raise ImageError("this model has no vision tower (vision_n_layers 0 or --language-model-only); "
                         "send text only or load the model with its vision weights")
    placeholders = sum(1 for t in token_ids if t == cfg.image_token_id)
    if placeholders != len(images):
        raise ImageError(f"the prompt has {placeholders} image placeholders but {len(images)} images were given")
    tokens, types, inputs = [], [], []
    it = iter(images)
    for t in token_ids:
        if t != cfg.image_token_id:
            tokens.append(int(t))
            types.append(TEXT)
            continue
        img = next(it)
        img = decode_image(img) if isinstance(img, (bytes, bytearray)) else img
        patches, grid = image_patches(img, cfg)
        span = span_types(grid.n_llm_h, grid.n_llm_w)
        inputs.append(ImageInput(len(tokens), patches, grid.n_vit_h, grid.n_vit_w))
        tokens += [cfg.image_token_id] * span.shape[0]
        types += span.tolist()
    return tokens, types, inputs

"""Images into the prompt: encode each image (ViT + aligner) and build the span rows the backbone
reads in place of the token embeddings (docs/VISION.md).

An image occupies [START] + ([IMAGE] x n_llm_w + [NEWLINE]) x n_llm_h + [END] positions of the
prompt, all carrying `image_token_id`; `token_types` tells them apart (TEXT -1 elsewhere). START,
END and NEWLINE take the learned delimiter vectors, the IMAGE slots the aligner rows in reading
order. `transformer.forward(..., spans=(rows, token_types))` does the replacement before the hc
expansion and routes every span position with `gate.bias_vl`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.runtime import Runtime, compiler_options

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


def llm_grid(n_vit_h: int, n_vit_w: int, downsample_ratio: int) -> tuple[int, int]:
    """The aligner's cell grid for a patch grid: ceil of each side over the downsample ratio."""
    r = downsample_ratio
    return -(-n_vit_h // r), -(-n_vit_w // r)


def span_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """Token types of one image span: START, n_llm_h rows of n_llm_w IMAGE + NEWLINE, END."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return np.asarray([IMAGE_START] + row * n_llm_h + [IMAGE_END], np.int64)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: where its span starts and its ViT patches (row-major over the grid)."""

    start: int
    patches: np.ndarray  # [n_vit_h * n_vit_w, 3, p, p]
    n_vit_h: int
    n_vit_w: int


def make_image_encoder(graphdef, runtime: Runtime = Runtime(), collect: bool = False):
    """A jitted (params, patches, n_vit_h, n_vit_w) -> (vit_output, vision_embeds[, trace]).

    Compiled once per patch-grid shape; params are the whole model's (only the tower is read).
    """
    @functools.partial(jax.jit, static_argnums=(2, 3), compiler_options=compiler_options(runtime.mode))
    def encode(params, patches, n_vit_h, n_vit_w):
        return encode_image(nnx.merge(graphdef, params), patches, n_vit_h, n_vit_w, runtime.mode, collect)

    return encode


def encode_image(model, patches, n_vit_h: int, n_vit_w: int, mode: str, collect: bool = False):
    """The tower and aligner over one image's patches: (vit_output, vision_embeds[, trace]); traced
    inside a caller's jit (`make_image_encoder`, the serving engine's image step)."""
    if model.vision is None:
        raise ValueError("this model has no vision tower (vision_n_layers 0 or --language-model-only)")
    trace = {} if collect else None
    feats = model.vision(patches, n_vit_h, n_vit_w, mode, trace)
    embeds = model.aligner(feats, n_vit_h, n_vit_w, mode)
    return (feats, embeds, trace) if collect else (feats, embeds)


def span_rows(model, token_types: np.ndarray, images: list[ImageInput], embeds: list) -> np.ndarray:
    """Rows [L, dim] (bf16) for a prompt of L positions: delimiters and aligner rows on the spans.

    token_types [L]; images and their aligner outputs `embeds` [n_cells, dim] in prompt order.
    Text positions get zeros (forward ignores them). Raises when a span disagrees with its image.
    """
    token_types = np.asarray(token_types)
    cfg = model.cfg
    rows = np.zeros((token_types.shape[0], cfg.dim), jnp.bfloat16)
    delim = {IMAGE_START: model.image_start, IMAGE_END: model.image_end, IMAGE_NEW_LINE: model.image_newline}
    covered = np.zeros(token_types.shape[0], bool)
    for k, (img, emb) in enumerate(zip(images, embeds, strict=True)):
        n_h, n_w = llm_grid(img.n_vit_h, img.n_vit_w, cfg.vision_downsample_ratio)
        want = span_types(n_h, n_w)
        got = token_types[img.start:img.start + want.shape[0]]
        if got.shape != want.shape or not np.array_equal(got, want):
            raise ValueError(f"image {k} at position {img.start}: token_types {got.tolist()} do not hold the span "
                             f"{want.tolist()} of its {img.n_vit_h} x {img.n_vit_w} patch grid")
        emb = np.asarray(emb)
        if emb.shape != (n_h * n_w, cfg.dim):
            raise ValueError(f"image {k}: aligner output has shape {emb.shape}, expected {(n_h * n_w, cfg.dim)}")
        span = rows[img.start:img.start + want.shape[0]]
        for t, p in delim.items():
            span[want == t] = np.asarray(p[...]).astype(jnp.bfloat16)
        span[want == IMAGE] = emb.astype(jnp.bfloat16)
        covered[img.start:img.start + want.shape[0]] = True
    stray = np.flatnonzero((token_types >= 0) & ~covered)
    if stray.size:
        raise ValueError(f"positions {stray[:8].tolist()} are marked as image-span tokens but no image covers them")
    return rows

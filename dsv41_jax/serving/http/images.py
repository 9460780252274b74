"""Images in chat requests: OpenAI `image_url` parts -> the prompt's image spans, which the engine prefills.

A chat request's image parts become image placeholders in the V4.1 prompt (the chat encoder,
`images=True`), each placeholder becomes its span (`vision/processor.expand_prompt`: START, rows
of IMAGE + NEWLINE, END), the tower and aligner run once per image, and `vision/merge.span_rows`
fills the span rows. The engine takes `Request.spans` and routes every span position with
`gate.bias_vl` in exact, chunked and split prefill alike; decode is unchanged.

The flags (`add_image_args`) and limits live here; `dsv41 serve` adds them and passes
`ImageOptions` to the server. Conversation caches match an image prompt on its `key`: the ids,
with each image position replaced by a negative value drawn from a hash of that image's processed
pixels (every image position has the same id, so matching on ids would resume another image's
cache for the same text).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import threading
import types

import numpy as np

from dsv41_jax.text import special_tokens as st
from dsv41_jax.text.chat import encode_chat_pieces, IMAGE_PART_TYPES, pieces_to_ids
from dsv41_jax.text.pieces import image_parts
from dsv41_jax.vision.merge import IMAGE_END, span_rows
from dsv41_jax.vision.processor import expand_prompt, ImageError
from dsv41_jax.vision.sources import ImageLimits, load_images

DEFAULT_MAX_IMAGE_TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """What `dsv41 serve` accepts in image requests (each a flag, each breach a 400 naming it)."""

    limits: ImageLimits = ImageLimits()
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS  # span positions per request (--max-image-tokens)


def has_images(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in messages)


@dataclasses.dataclass
class ImagePrompt:
    tokens: list[int]
    spans: tuple  # (rows [L, dim] bf16, token_types [L]) for Request.spans
    digest: str  # sha256 of the processed pixels of every image, in order
    n_images: int
    key: list[int] | None = None  # conversation-cache match key (`pixel_key`)


def pixel_key(tokens, inputs, span_lengths) -> list[int]:
    """The ids with every image-span position replaced by a negative int32 that depends on the image's
    processed pixels (patches and grid) and the position within the span: 31 bits per position from
    SHAKE-256, so two different images share a key only if every position of their spans collides."""
    key = [int(t) for t in tokens]
    for img, n in zip(inputs, span_lengths):
        h = hashlib.sha256(np.ascontiguousarray(img.patches).tobytes())
        h.update(np.asarray([img.n_vit_h, img.n_vit_w, n], np.int64).tobytes())
        words = np.frombuffer(hashlib.shake_256(h.digest()).digest(4 * n), np.uint32) & np.uint32(0x7FFFFFFF)
        key[img.start:img.start + n] = (-1 - words.astype(np.int64)).tolist()
    return key


class ImagePrompter:
    """Turns a chat request with images into its prompt ids and spans, for one loaded engine. The
    tower runs as the engine's `encode_image` (across processes its lockstep publishes it, so every
    process runs the same program on its shards)."""

    def __init__(self, engine, opts: ImageOptions):
        from flax import nnx

        self.engine, self.opts, self.cfg = engine, opts, engine.cfg
        if getattr(nnx.merge(engine.graphdef, engine.params), "vision", None) is None:
            raise ValueError("this model was built without its vision tower (a language-model-only load); "
                             "images need the checkpoint's vision weights")
        self.lock = threading.Lock()  # one image encode at a time (each compiles per grid shape on first use)

    def build(self, tokenizer, messages, *, with_spans: bool = True, encode=None, **chat) -> ImagePrompt:
        """ids and spans; raises ImageError (bad image, a limit) or ValueError (bad messages).
        `with_spans=False` (for /tokenize) stops after the prompt's ids: no tower, spans None.
        encode: how the tower is run, (patches, n_vit_h, n_vit_w) -> `Engine.encode_image`'s result
        (default: the engine's, from this thread)."""
        encode = encode or self.engine.encode_image
        tokens, token_types, inputs = image_prompt(tokenizer, messages, self.cfg, self.opts, **chat)
        digest = hashlib.sha256()
        lengths = _span_lengths(token_types, inputs)
        if not with_spans:
            for img in inputs:
                digest.update(np.ascontiguousarray(img.patches).tobytes())
            return ImagePrompt(tokens, None, digest.hexdigest(), len(inputs), pixel_key(tokens, inputs, lengths))
        embeds, delimiters = [], {}
        with self.lock:
            for img in inputs:
                digest.update(np.ascontiguousarray(img.patches).tobytes())
                emb, delimiters = encode(img.patches, img.n_vit_h, img.n_vit_w)
                embeds.append(emb)
        # span_rows reads the config and the three learned delimiter vectors
        rows = span_rows(types.SimpleNamespace(cfg=self.cfg, **delimiters), np.asarray(token_types), inputs, embeds)
        return ImagePrompt(tokens, (rows, np.asarray(token_types, np.int64)), digest.hexdigest(), len(inputs),
                           pixel_key(tokens, inputs, lengths))


def _span_lengths(token_types, inputs) -> list[int]:
    """Each image's span length: from its start to its IMAGE_END (inclusive)."""
    types = np.asarray(token_types)
    ends = np.flatnonzero(types == IMAGE_END)
    return [int(ends[ends >= img.start][0]) - img.start + 1 for img in inputs]


def image_prompt(tokenizer, messages, cfg, opts: ImageOptions, **chat):
    """A chat with image parts -> (ids with each image's span, token types, image inputs): the chat
    encoder, the image sources under `opts`' limits and the processor; no weights needed.
    Raises ImageError (bad image, a limit) or ValueError (bad messages)."""
    _no_typed_placeholder(messages)
    pieces = encode_chat_pieces(messages, images=True, **chat)
    parts, ids = image_parts(pieces), pieces_to_ids(tokenizer, pieces)
    images = load_images(parts, opts.limits)
    tokens, token_types, inputs = expand_prompt(ids, images, cfg)
    n_span = int(np.sum(np.asarray(token_types) >= 0))
    if n_span > opts.max_image_tokens:
        raise ImageError(f"the images take {n_span} prompt positions, over the limit of "
                         f"{opts.max_image_tokens} per request (--max-image-tokens); send fewer or smaller images")
    return tokens, token_types, inputs


def _no_typed_placeholder(messages) -> None:
    """In a request with images, a typed image placeholder is refused (text-only requests keep it as text):
    the client most likely meant an image part, and a silent rewrite would shift which image goes where."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        texts = [content] if isinstance(content, str) else [
            p.get("text") for p in (content or ()) if isinstance(p, dict) and p.get("type") == "text"]
        if any(isinstance(t, str) and st.IMAGE in t for t in texts):
            raise ImageError(f"messages[{i}]: the text contains the image placeholder {st.IMAGE!r}; send each image "
                             "as an image_url content part instead")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_image_args(parser) -> None:
    """The image flags of `dsv41 serve`."""
    g = parser.add_argument_group("images (checkpoints with a vision tower)")
    d = ImageLimits()
    g.add_argument("--max-images-per-request", type=_positive, default=d.max_images,
                   help=f"images per chat request (default {d.max_images})")
    g.add_argument("--max-image-bytes", type=_positive, default=d.max_bytes,
                   help=f"encoded bytes per image (default {d.max_bytes})")
    g.add_argument("--max-image-pixels", type=_positive, default=d.max_pixels,
                   help=f"decoded pixels per image, refused before decoding (default {d.max_pixels})")
    g.add_argument("--max-image-tokens", type=_positive, default=DEFAULT_MAX_IMAGE_TOKENS,
                   help=f"image span positions per request (default {DEFAULT_MAX_IMAGE_TOKENS})")
    g.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs (off: only data URLs and --allowed-media-dir files)")
    g.add_argument("--allowed-media-dir", metavar="DIR", default=None,
                   help="serve image parts that name local files under DIR (off by default)")


def image_options(args) -> ImageOptions:
    limits = ImageLimits(max_images=args.max_images_per_request, max_bytes=args.max_image_bytes,
                         max_pixels=args.max_image_pixels, allow_urls=args.allow_image_urls,
                         media_dir=args.allowed_media_dir)
    return ImageOptions(limits=limits, max_image_tokens=args.max_image_tokens)

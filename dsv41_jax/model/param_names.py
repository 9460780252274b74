"""The model's parameter tree by the reference's state-dict names (docs/REFERENCE.md §9).

The reference (and the HF checkpoint, which uses the same bare names) stores one tensor per
expert matrix; the model stacks experts, so `layers.L.ffn.experts.E.w1.weight` is row E of
`layers[L].ffn.experts.w1`. The naming describes the model, so it lives here: `checkpoint/`
(reading and writing files) and `model/info.py` (parameter counts) both read it.
"""
from __future__ import annotations

import re

from flax import nnx

# backbone layers (layers.L) and DSpark stages (mtp.K) share the block's names
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_RENAMES = [  # (reference suffix regex, our path template); `reference_name` is the inverse
    (r"hc_(attn|ffn)_fn", r"hc_\1.fn"), (r"hc_(attn|ffn)_base", r"hc_\1.base"), (r"hc_(attn|ffn)_scale", r"hc_\1.scale"),
    (r"attn\.attn_sink", "attn.attn_sink"),
    (r"engram\.embed\.weight", "engram.embed"), (r"engram\.embed\.scale", "engram.embed_scale"),
    (r"ffn\.gate\.weight", "ffn.gate.weight"), (r"ffn\.gate\.bias", "ffn.gate.bias"),
]


def our_path(name: str) -> tuple | None:
    """Reference name -> (our parameter path, expert index or None); None for names we don't model."""
    if name in ("embed.weight", "head.weight"):
        return (name.split(".")[0],), None
    if name == "norm.weight":
        return ("norm", "weight"), None
    if name in VISION_DELIMITERS:
        return (name,), None
    if name.startswith(("vision.", "aligner.")):  # the tower's modules mirror the checkpoint names
        return tuple(int(p) if p.isdigit() else p for p in name.split(".")), None
    m = _EXPERT.match(name)
    if m:
        top, l, e, w, kind = m.groups()
        return (top, int(l), "ffn", "experts", w if kind == "weight" else f"{w}_scale"), int(e)
    m = re.match(r"^(layers|mtp)\.(\d+)\.(.+)$", name)
    if not m:
        return None
    top, l, rest = m.group(1), int(m.group(2)), m.group(3)
    for pat, rep in _RENAMES:
        if re.fullmatch(pat, rest):
            rest = re.sub(pat, rep, rest)
            break
    return (top, l, *[int(p) if p.isdigit() else p for p in rest.split(".")]), None


VISION_DELIMITERS = ("image_start", "image_end", "image_newline")


def is_vision_name(name: str) -> bool:
    """The VL part of a checkpoint: tower, aligner, span delimiters and the per-layer `gate.bias_vl`."""
    return name.startswith(("vision.", "aligner.")) or name in VISION_DELIMITERS or name.endswith("gate.bias_vl")


def flat_params(model_or_state) -> dict[tuple, nnx.Variable]:
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    return {tuple(k): v for k, v in nnx.to_flat_state(state)}


def reference_name(path: tuple) -> str:
    """Our non-expert parameter path -> the reference state-dict name."""
    if path[0] in ("embed", "head"):
        return f"{path[0]}.weight"
    if path == ("norm", "weight"):
        return "norm.weight"
    if path[0] in VISION_DELIMITERS or path[0] in ("vision", "aligner"):
        return ".".join(map(str, path))
    rest = ".".join(map(str, path[2:]))
    rest = re.sub(r"^hc_(attn|ffn)\.(fn|base|scale)$", r"hc_\1_\2", rest)
    rest = {"engram.embed": "engram.embed.weight", "engram.embed_scale": "engram.embed.scale"}.get(rest, rest)
    return f"{path[0]}.{path[1]}.{rest}"

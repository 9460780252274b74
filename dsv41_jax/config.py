"""ModelConfig: the frozen description of a V4.1 model, its readers/writers and its layer roles.

Field names follow the reference `ModelArgs` (the flat `inference/config.json`), so the golden
configs pass through unchanged; the HF `config.json` (nested `text_config`, transformers key
names) is mapped onto them. Layer roles (docs/REFERENCE.md §2) are derived once, and a malformed config is
refused with a message that names the field and the layer.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dsv41_jax.config_checks import ConfigError, ConfigWarning, check_layout

SUPPORTED_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


@dataclass(frozen=True)
class LayerRole:
    """What one layer owns and reads (docs/REFERENCE.md §2)."""

    layer: int
    kind: Literal["swa", "full", "reindex", "reuse"]
    half: Literal["encoder", "decoder"]
    ratio: int
    kv_source: int | None  # layer whose compressed KV this layer attends over
    index_source: int | None  # layer whose top-k this layer uses (itself when it runs an indexer)
    is_kv_source: bool
    is_index_source: bool
    is_candidate_source: bool
    uses_candidates: bool  # restricts its own top-k to the candidate pool
    has_engram: bool


# flat-key <- HF text_config key; identity entries are omitted
_HF_TO_FLAT = {
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "max_position_embeddings": "max_position_embeddings",
}

# flat-key <- HF vision_config key
_HF_VISION_TO_FLAT = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim", "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim", "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}
VISION_FIELDS = tuple(_HF_VISION_TO_FLAT.values())


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a DeepSeek-V4.1 text backbone, plus runtime cache limits."""

    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_heads: int = 64
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dtype: Literal["fp8", "bf16"] = "fp8"
    expert_dtype: Literal["fp4"] | None = "fp4"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    # DSpark, the speculative drafter (docs/ARCHITECTURE.md "DSpark"): n_mtp_layers window-only
    # stages stored as mtp.{k}.*, a 1 + (block_size - 1) token block, taps of the target layers
    n_mtp_layers: int = 3
    # vision tower + aligner (docs/VISION.md); vision_n_layers 0 = text only (no tower, no bias_vl)
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # runtime limits: they size the caches, not the weights
    max_seq_len: int = 4096
    max_batch_size: int = 4
    # keys we carry for round-tripping but do not model (DSpark, vision, ...)
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def v41_flash(cls, **overrides) -> "ModelConfig":
        """The released DeepSeek-V4.1-Flash shapes."""
        return cls(**overrides).validated()

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A small test model with every role: SWA, Full r2, Reuse, Reindex r2, Full r1 + pool, Reindex r1."""
        base = dict(
            vocab_size=512, dim=128, moe_inter_dim=64, n_layers=7, n_heads=4, n_routed_experts=8,
            n_activated_experts=2, q_lora_rank=64, head_dim=64, rope_head_dim=32, o_groups=2,
            o_lora_rank=32, window_size=8, compress_ratios=(0, 2, 2, 2, 1, 1, 1),
            kv_source_layers=(1, 4), index_source_layers=(1, 3, 4, 5), original_seq_len=64,
            index_n_heads=4, index_head_dim=64, index_topk=8, candidate_source_layer=4,
            candidate_topk_blocks=3, candidate_block_size=4, engram_layer_ids=(1, 3),
            engram_num_embeddings=(), engram_vocab_size=600, engram_n_heads=2, engram_head_dim=32,
            engram_compressed_vocab_size=389, n_mtp_layers=0, max_seq_len=128, max_batch_size=2,
            vision_n_layers=0,
        )
        base.update(overrides)
        return cls(**base).validated()

    @classmethod
    def tiny_vision(cls, **overrides) -> "ModelConfig":
        """`tiny` with a 2-layer vision tower (patch 4, grids up to 64 span tokens). Its image token is 264,
        the id of the byte-level tokenizer's image placeholder (`ByteTokenizer.save_json(image_token=True)`),
        so the pair serves images."""
        base = dict(vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=48, vision_patch_size=4,
                    vision_max_n_token=64, vision_min_pixels=256, image_token_id=264)
        base.update(overrides)
        return cls.tiny(**base)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        presets = {"v41-flash": cls.v41_flash, "tiny": cls.tiny, "tiny-noengram": lambda: cls.tiny(engram_layer_ids=()),
                   "tiny-vision": cls.tiny_vision}
        if name not in presets:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(presets)} or pass a config.json path")
        return presets[name]()

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Read a flat `inference/config.json` / golden `model_args`, or an HF `config.json`."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a config must be a JSON object of fields, got a {_json_type(d)}")
        d = dict(d)
        top_type = d.get("model_type")
        if "text_config" in d or top_type is not None:
            text = d.get("text_config", d)
            if not isinstance(text, Mapping):
                raise ConfigError(f"text_config: must be an object of model fields, got a {_json_type(text)}")
            text = dict(text)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
                if key in d and key not in text:
                    text[key] = d[key]
            mt = text.get("model_type", top_type)
            for t in (top_type, mt):
                if t is not None and t not in SUPPORTED_MODEL_TYPES:
                    hint = (" V4 checkpoints have per-layer compressors and no kv/index source layers;"
                            " this package implements V4.1 (deepseek_v41) only.") if str(t).startswith("deepseek_v4") else ""
                    raise ConfigError(f"model_type {t!r} is not supported (expected one of {SUPPORTED_MODEL_TYPES}).{hint}")
            flat = {}
            for k, v in text.items():
                flat[_HF_TO_FLAT.get(k, k)] = v
            rs = flat.pop("rope_scaling", None) or {}
            q = d.get("quantization_config") or {}
            for name, value in (("rope_scaling", rs), ("quantization_config", q)):
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{name}: must be an object, got a {_json_type(value)}")
            if rs:
                flat["rope_factor"] = rs.get("factor", 1.0)
                flat["beta_fast"] = rs.get("beta_fast", 32)
                flat["beta_slow"] = rs.get("beta_slow", 1)
                flat["original_seq_len"] = rs.get("original_max_position_embeddings", 0)
            flat.pop("model_type", None)
            flat.setdefault("dtype", "fp8" if q.get("quant_method") == "fp8" else "bf16")
            flat.setdefault("expert_dtype", q.get("expert_dtype"))
            vision = d.get("vision_config")
            if vision is None:  # an HF config without a vision_config describes a text-only model
                flat.setdefault("vision_n_layers", 0)
            else:
                for k, v in vision.items():
                    if k in _HF_VISION_TO_FLAT:
                        flat[_HF_VISION_TO_FLAT[k]] = v
            extra = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
            flat["_hf_extra"] = extra
            d = flat
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs, extra = {}, {}
        for k, v in d.items():
            if k in known and k != "extra":
                kwargs[k] = tuple(v) if isinstance(v, list) else v
            else:
                extra[k] = v
        if "n_routed_experts" in kwargs and "n_activated_experts" not in kwargs and "num_experts_per_tok" in extra:
            kwargs["n_activated_experts"] = extra["num_experts_per_tok"]
        _warn_misspelt(extra, known)
        kwargs["extra"] = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in extra.items()))
        return cls(**kwargs).validated()

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> "ModelConfig":
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} holds a JSON {_json_type(d)}, not an object of config fields")
        if "model_args" in d:  # golden-folder config
            d = d["model_args"]
        return cls.from_dict(d)

    @classmethod
    def load(cls, preset_or_path: str) -> "ModelConfig":
        p = pathlib.Path(preset_or_path)
        if p.suffix == ".json" or p.is_dir() or p.exists():
            return cls.from_file(p)
        return cls.preset(preset_or_path)

    # ------------------------------------------------------------------ writers
    def to_flat_dict(self) -> dict:
        """The flat `inference/config.json` form (ModelArgs key names)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        for k, v in self.extra:
            if k != "_hf_extra":
                out[k] = json.loads(v)
        return out

    def to_hf_dict(self) -> dict:
        """The HF `config.json` form (nested text_config, transformers key names)."""
        flat = self.to_flat_dict()
        inv = {v: k for k, v in _HF_TO_FLAT.items()}
        text = {"model_type": "deepseek_v41_text"}
        skip = {"rope_factor", "beta_fast", "beta_slow", "original_seq_len", "dtype", "expert_dtype",
                "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "max_batch_size",
                *VISION_FIELDS}
        for k, v in flat.items():
            if k in skip:
                continue
            text[inv.get(k, k)] = v
        text["rope_scaling"] = {"rope_type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                                "beta_slow": self.beta_slow, "original_max_position_embeddings": self.original_seq_len}
        hf = {}
        for k, v in self.extra:
            if k == "_hf_extra":
                hf.update(json.loads(v))
        hf.update({
            "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "image_token_id": self.image_token_id,
            "text_config": text,
            "vision_config": {"model_type": "deepseek_v41_vision",
                              **{hf_key: flat[key] for hf_key, key in _HF_VISION_TO_FLAT.items()}},
        })
        if self.dtype == "fp8":
            hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                         "expert_dtype": self.expert_dtype}
        else:
            hf.pop("quantization_config", None)
        return hf

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes).validated()

    # ------------------------------------------------------------------ derived roles
    @property
    def vision_enabled(self) -> bool:
        """Whether the model has the vision tower, aligner, span delimiters and `gate.bias_vl`."""
        return self.vision_n_layers > 0

    def language_model_only(self) -> "ModelConfig":
        """This config without the vision path (vLLM's --language-model-only): no tower, no bias_vl."""
        return self.replace(vision_n_layers=0)

    @property
    def roles(self) -> tuple[LayerRole, ...]:
        return _derive_roles(self)

    @property
    def has_dspark(self) -> bool:
        """Whether the config describes the DSpark drafter (reference: `dspark_block_size` and stages)."""
        return self.n_mtp_layers > 0 and self.dspark_block_size > 0

    def without_dspark(self) -> "ModelConfig":
        """The same backbone with no drafter (a checkpoint that ships no mtp.* tensors)."""
        return self.replace(n_mtp_layers=0)

    @property
    def dspark_moe(self) -> tuple[int, int]:
        """(routed, activated) experts of a DSpark stage; 0 falls back to the backbone's (reference)."""
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def decoder_start(self) -> int:
        """First decoder layer: the first ratio-1 KV source (the CED projection); n_layers if none."""
        for s in self.kv_source_layers:
            if self.compress_ratios[s] == 1:
                return s
        return self.n_layers

    @property
    def index_kv_sources(self) -> tuple[int, ...]:
        """KV sources that also own index keys (they run an indexer of their own)."""
        return tuple(s for s in self.kv_source_layers if s in self.index_source_layers)

    @property
    def topk_width(self) -> dict[int, int]:
        """Static top-k width per KV source: min(index_topk, entries the cache can hold)."""
        return {s: min(self.index_topk, self.max_seq_len // self.compress_ratios[s]) for s in self.kv_source_layers}

    def validated(self) -> "ModelConfig":
        """This config, checked: each field's type and size here, how the layers fit together in
        `config_checks.check_layout`; a ConfigError names the field (and the layer)."""
        _check_types(self)
        _check_sizes(self)
        check_layout(self)
        return self


_FLAT_TO_HF = {v: k for k, v in _HF_TO_FLAT.items() if k != v}
_MISSING = object()

# Sizes that must be at least 1, and generous ceilings (tens of times the release) that catch a
# typo such as 1e6 layers before anything is built from it; token ids are int32 on device.
_POSITIVE = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts", "n_activated_experts",
             "q_lora_rank", "head_dim", "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
             "index_topk", "hc_mult", "max_seq_len", "max_batch_size")
_CEILINGS = {
    "vocab_size": (2**31 - 1, "token ids are int32"), "n_layers": (1024, "the release has 43"),
    "n_routed_experts": (65536, "the release has 384"), "max_seq_len": (2**30, "positions are int32"),
    "max_batch_size": (2**20, "caches are sized by it"),
    **{n: (65536, "the release's largest width is 7168") for n in
       ("dim", "moe_inter_dim", "q_lora_rank", "head_dim", "o_lora_rank", "index_head_dim", "engram_head_dim")},
    **{n: (4096, "the release has 64 heads") for n in ("n_heads", "index_n_heads", "engram_n_heads", "o_groups")},
    **{n: (2**20, "far beyond any V4.1 model") for n in ("window_size", "index_topk", "candidate_topk_blocks",
                                                        "candidate_block_size", "hc_mult", "hc_sinkhorn_iters")},
    "engram_vocab_size": (2**40, "far beyond the release's 1.6e7"),
}


def _json_type(value) -> str:
    """The JSON name of a Python value's type, for messages about config files."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", tuple: "list",
             dict: "object", type(None): "null"}
    return next((n for t, n in names.items() if type(value) is t), type(value).__name__)


def _label(name: str) -> str:
    hf = _FLAT_TO_HF.get(name)
    return f"{name} (HF config.json: {hf})" if hf else name


def _check_types(c: ModelConfig) -> None:
    """Each field holds the JSON type its default has; otherwise a ConfigError naming it."""
    for f in dataclasses.fields(c):
        if f.name == "extra":
            continue
        value, default = getattr(c, f.name), f.default
        if f.name == "expert_dtype" and value is None:
            continue
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        elif isinstance(default, str):
            ok, want = isinstance(value, str), "a string"
        elif isinstance(default, tuple):
            ok = isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            want = "a list of integers"
        else:
            continue
        if not ok:
            raise ConfigError(f"{_label(f.name)}: must be {want}, got {value!r} ({_json_type(value)})")


def _check_sizes(c: ModelConfig) -> None:
    for name in _POSITIVE:
        if getattr(c, name) <= 0:
            raise ConfigError(f"{_label(name)}: must be at least 1, got {getattr(c, name)}")
    for name, (ceiling, why) in _CEILINGS.items():
        if getattr(c, name) > ceiling:
            raise ConfigError(f"{_label(name)}: {getattr(c, name)} is beyond any V4.1 model (at most {ceiling}: {why}); "
                              "is it a typo?")
    for n in c.engram_num_embeddings:
        if not 0 < n <= 2**40:
            raise ConfigError(f"engram_num_embeddings: {n} must be in 1..2**40")
    for name in ("n_mtp_layers", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim"):
        if getattr(c, name) < 0:
            raise ConfigError(f"{_label(name)}: must not be negative, got {getattr(c, name)}")


# Keys of the released configs that this package carries but does not model (DSpark and the vision
# tower have their own prefixes); they are never reported as typos.
RELEASE_EXTRA_KEYS = frozenset({"hidden_act", "max_position_embeddings", "num_key_value_heads", "temperature",
                                "tie_word_embeddings", "topk_method"})
_EXTRA_PREFIXES = ("dspark_", "vision_", "_")


def _warn_misspelt(extra: Mapping, known: set) -> None:
    """Warn about extra keys that look like a typo of a field name (flat or HF spelling)."""
    names = sorted((known - {"extra"}) | set(_HF_TO_FLAT))
    for key in extra:
        if key.startswith(_EXTRA_PREFIXES) or key in RELEASE_EXTRA_KEYS or key in names:
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        if close:
            warnings.warn(f"config key {key!r} is not a V4.1 field; did you mean {close[0]!r}? "
                          "(it is kept as an extra key and not used)", ConfigWarning, stacklevel=3)


def _derive_roles(c: ModelConfig) -> tuple[LayerRole, ...]:
    roles = []
    dec = c.decoder_start
    for l in range(c.n_layers):
        r = c.compress_ratios[l]
        kv = max((s for s in c.kv_source_layers if s <= l), default=None) if r else None
        ix = max((s for s in c.index_source_layers if s <= l), default=None) if r else None
        is_kv = l in c.kv_source_layers
        is_ix = l in c.index_source_layers
        if r == 0:
            kind = "swa"
        elif is_kv:
            kind = "full"
        elif is_ix:
            kind = "reindex"
        else:
            kind = "reuse"
        cs = c.candidate_source_layer
        roles.append(LayerRole(
            layer=l, kind=kind, half="encoder" if l < dec else "decoder", ratio=r, kv_source=kv,
            index_source=ix, is_kv_source=is_kv, is_index_source=is_ix,
            is_candidate_source=(l == cs), uses_candidates=(is_ix and 0 <= cs < l and kv == cs),
            has_engram=l in c.engram_layer_ids,
        ))
    return tuple(roles)

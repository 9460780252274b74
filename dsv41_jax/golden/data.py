"""Reading a golden folder (the oracle's format, golden/README.md): configs, weights, cases.

Nothing here assumes particular file names or lengths: configs are the sub-folders that hold
a `cases.json`, and every case lists its own tensors.
"""
from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass

import numpy as np

from dsv41_jax.checkpoint.weights import load_reference_state_dict
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram.hashing import EngramLayout


def _load_safetensors(path: pathlib.Path, names=None) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "flax") as f:
        for k in (names if names is not None else f.keys()):
            out[k] = np.asarray(f.get_tensor(k))
    return out


@dataclass
class GoldenConfig:
    """One config folder: its model config, raw JSON, and cases."""

    root: pathlib.Path
    name: str
    cfg: ModelConfig
    raw: dict
    cases: list[dict]

    @property
    def weights_path(self) -> pathlib.Path:
        return self.root / self.cases_json.get("weights_file", "weights.safetensors")

    @functools.cached_property
    def cases_json(self) -> dict:
        return json.loads((self.root / "cases.json").read_text())

    def case_tensors(self, case: dict) -> dict[str, np.ndarray]:
        return _load_safetensors(self.root / case["file"])

    def load_model(self):
        """The model with this folder's weights (reference state-dict names)."""
        from safetensors import safe_open

        with safe_open(str(self.weights_path), "flax") as f:
            names = list(f.keys())
            model, _ = load_reference_state_dict(self.cfg, lambda n: np.asarray(f.get_tensor(n)), names)
        return model

    def longest_prefill(self) -> list[int] | None:
        """The tokens of this folder's longest text prefill case, or None (the DSpark and vision
        folders hold none)."""
        prefills = [c for c in self.cases if c["kind"] == "prefill"]
        return max(prefills, key=lambda c: len(c["tokens"]))["tokens"] if prefills else None

    def engram_hasher(self):
        """(layout, token_map) for Engram configs, else None."""
        if not self.cfg.engram_layer_ids:
            return None

        eng = self.raw["engram"]
        layout = EngramLayout.from_golden_json(eng, self.raw["model_args"])
        return layout, np.asarray(eng["token_map"], np.int64)


def discover(root: str | pathlib.Path) -> list[GoldenConfig]:
    """Every config folder under root (folders that hold cases.json and config.json)."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"golden folder {root} does not exist")
    out = []
    for d in sorted(p for p in root.iterdir() if (p / "cases.json").is_file() and (p / "config.json").is_file()):
        raw = json.loads((d / "config.json").read_text())
        cfg = ModelConfig.from_dict(raw["model_args"])
        cases = json.loads((d / "cases.json").read_text())["cases"]
        out.append(GoldenConfig(d, raw.get("name", d.name), cfg, raw, cases))
    return out


def load_quant_vectors(root: str | pathlib.Path):
    """(tensors, json) of the kernel vectors, or None when the folder has none."""
    root = pathlib.Path(root)
    st, js = root / "quant_vectors.safetensors", root / "quant_vectors.json"
    if not st.is_file():
        return None
    return _load_safetensors(st), (json.loads(js.read_text()) if js.is_file() else {})

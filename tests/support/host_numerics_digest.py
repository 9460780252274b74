"""Digests of every host-computed table and exact-mode elementwise function, for
tests/numerics/test_host_dispatch.py: the test runs this once as found and once in a subprocess with
numpy's AVX-512 dispatch disabled (and XLA's CPU codegen held to AVX2), and the bits must agree.

Usage: python tests/support/host_numerics_digest.py [GOLDEN_ROOT]  -> JSON {name: sha256 of the bits}
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (dim, base, original_seq_len, factor, beta_fast, beta_slow): the shared golden settings
# (theta 160000 with YaRN is the one numpy's AVX-512 pow rounded differently) and wider dims
ROPE_SETTINGS = [(32, 1e4, 0, 1.0, 32, 1), (32, 1.6e5, 64, 16.0, 32, 1), (32, 2e4, 64, 16.0, 32, 1),
                 (64, 1e4, 0, 1.0, 32, 1), (64, 1.6e5, 4096, 16.0, 32, 1), (128, 5e5, 8192, 40.0, 32, 1),
                 (16, 1e6, 128, 4.0, 16, 2)]


def _h(*arrays) -> str:
    m = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        m.update(str((a.dtype, a.shape)).encode())
        m.update(a.tobytes())
    return m.hexdigest()


def _inputs(n: int = 4099) -> np.ndarray:
    """float32 inputs: a spread of magnitudes and signs plus edge values; n is not a multiple of
    any vector width, so every remainder path of a vectorised implementation is taken."""
    rng = np.random.default_rng(28)
    x = np.concatenate([(rng.standard_normal(n) * 8).astype(np.float32),
                        (rng.standard_normal(n) * 80).astype(np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 20.0, 20.000002, 88.7, -88.7, 103.9, -103.9, 1e-7],
                                 np.float32)])
    return x


def digests(golden_root: str | None = None) -> dict[str, str]:
    import jax

    jax.config.update("jax_enable_x64", True)  # exact mode's float64 emulations
    import jax.numpy as jnp

    from dsv41_jax.layers import rope
    from dsv41_jax.numerics import activations, glibc_expf, glibc_log1pf, libm_powf, libm_sincos, mkl_exp, sleef_exp, sleef_powf
    from dsv41_jax.numerics.exact_ops import exact_sqrt, true_divide
    from dsv41_jax.numerics.mkl_sqrt import sqrt_mkl
    from dsv41_jax.vision.tower import rope_2d

    out: dict[str, str] = {}
    settings = list(ROPE_SETTINGS)
    if golden_root:
        for cfg in sorted(Path(golden_root).glob("*/config.json")):
            a = json.loads(cfg.read_text()).get("model_args")
            if a:
                settings.append((a["rope_head_dim"], a["rope_theta"], 0, 1.0, 32, 1))
                settings.append((a["rope_head_dim"], a["compress_rope_theta"], a["original_seq_len"],
                                 a["rope_factor"], a["beta_fast"], a["beta_slow"]))
    for s in dict.fromkeys(settings):
        rope.rope_table.cache_clear()
        t = rope.rope_table(s[0], 512, *s[1:])
        out[f"rope_table{s}"] = _h(t.freqs, t.cos, t.sin)
    out["vision_rope_2d"] = _h(*(np.asarray(v) for v in rope_2d(7, 9, 64, 1e4)))

    x = _inputs()
    grid = np.linspace(0, 1, 257, dtype=np.float32)
    out["libm_powf"] = _h(libm_powf.powf(np.float32(1.6e5), grid), libm_powf.powf(np.abs(x), x / 16))
    out["libm_sincos"] = _h(libm_sincos.cosf(x * 50), libm_sincos.sinf(x * 50))
    ax = np.abs(x) + np.float32(1.0)
    out["sleef_powf"] = _h(sleef_powf.powf_u10(ax, x / 16), sleef_powf.rope_pow(1.6e5, np.arange(0, 80, 2, np.float32) / 80))

    xj = jnp.asarray(x)
    fns = {
        "expf_glibc": lambda v: glibc_expf.expf_glibc(v),
        "expf_u10": sleef_exp.expf_u10,
        "expf_mkl": mkl_exp.expf_mkl,
        "log1pf_u10": lambda v: sleef_exp.log1pf_u10(jnp.abs(v)),
        "log1pf_glibc": lambda v: glibc_log1pf.log1pf_glibc(jnp.abs(v)),
        "softplus_tail": lambda v: activations.softplus(v[:4096].reshape(-1, 8), "exact", tail_dims=1),
        "sigmoid_tail": lambda v: activations.sigmoid(v[:4099].reshape(-1, 1), "exact", tail_dims=2),
        "sigmoid": lambda v: activations.sigmoid(v, "exact"),
        "silu": lambda v: activations.silu(v, "exact"),
        "softplus": lambda v: activations.softplus(v, "exact"),
        "gelu_erf": lambda v: activations.gelu_erf(v, "exact"),
        "softmax": lambda v: activations.softmax_lastdim(v[:4096].reshape(64, 64), "exact"),
        "exact_sqrt": lambda v: exact_sqrt(jnp.abs(v)),
        "sqrt_mkl": lambda v: sqrt_mkl(jnp.abs(v)),
        "true_divide": lambda v: true_divide(v, v[::-1] + 0.5),
    }
    for name, fn in fns.items():
        out[name] = _h(np.asarray(jax.jit(fn)(xj)))
    return out


if __name__ == "__main__":
    print(json.dumps(digests(sys.argv[1] if len(sys.argv) > 1 else None)))

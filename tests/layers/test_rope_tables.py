"""RoPE tables equal the reference's `precompute_freqs_cis` bit for bit (docs/NUMERICS.md, "RoPE tables").

Oracles: the stored `rope.safetensors` of every shared golden config (default suite); the C
library's cosf/sinf; torch running a transcription of the reference formula over a sweep of
theta, dims and YaRN parameters (slow).
"""
import ctypes
import ctypes.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv41_jax.layers import rope
from dsv41_jax.numerics import libm_sincos


def _golden_rope_dirs(golden_root):
    dirs = sorted(p.parent for p in Path(golden_root).glob("*/rope.safetensors"))
    if not dirs:
        pytest.skip(f"no rope.safetensors under {golden_root}")
    return dirs


def test_tables_equal_every_stored_golden_table(golden_root):
    from safetensors.numpy import load_file

    for folder in _golden_rope_dirs(golden_root):
        stored = load_file(str(folder / "rope.safetensors"))
        a = json.loads((folder / "config.json").read_text())["model_args"]
        tables = {
            "window_layers": rope.rope_table(a["rope_head_dim"], a["max_seq_len"], a["rope_theta"]),
            "compressed_layers": rope.rope_table(a["rope_head_dim"], a["max_seq_len"], a["compress_rope_theta"],
                                                 a["original_seq_len"], a["rope_factor"], a["beta_fast"],
                                                 a["beta_slow"]),
        }
        for name, table in tables.items():
            for part in ("cos", "sin"):
                ref = stored[f"{name}.{part}"]
                got = getattr(table, part)
                assert got.shape == ref.shape, (folder.name, name, part)
                diff = int(np.sum(got.view(np.uint32) != ref.view(np.uint32)))
                assert diff == 0, f"{folder.name} {name}.{part}: {diff} of {ref.size} entries differ"


def test_model_lookup_returns_the_table_rows():
    """cos_sin inside the model is a row lookup of the host table (no backend cos)."""
    import jax
    import jax.numpy as jnp

    table = rope.rope_table(32, 128, 2e4)
    pos = jnp.array([[0, 5, 127], [64, 1, 2]])
    cos, sin = jax.jit(lambda p: rope.cos_sin(p, table))(pos)
    np.testing.assert_array_equal(np.asarray(cos), table.cos[np.asarray(pos)])
    np.testing.assert_array_equal(np.asarray(sin), table.sin[np.asarray(pos)])


def _libm():
    name = ctypes.util.find_library("m")
    if not sys.platform.startswith("linux") or name is None:
        pytest.skip("needs glibc's libm (Linux)")
    lib = ctypes.CDLL(name)
    if not hasattr(lib, "gnu_get_libc_version") and not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc")
    for fn in ("cosf", "sinf"):
        getattr(lib, fn).restype = ctypes.c_float
        getattr(lib, fn).argtypes = [ctypes.c_float]
    return lib


def _edge_angles():
    f = np.float32
    specials = [0.0, -0.0, 2.0 ** -12, 2.0 ** -13, 1e-40, math.pi / 4, np.nextafter(f(math.pi / 4), f(0)),
                119.99999, 120.0, 120.00001, 127.0, 1e4, 3.0e38, -1.0, -120.0, -7e5]
    grid = np.arange(0, 4096, dtype=f)[:, None] * f(1.0)  # every integer position x freq 1
    return np.concatenate([np.array(specials, f), grid.ravel()])


def test_sincos_transcription_equals_the_c_library():
    lib = _libm()
    rng = np.random.default_rng(7)
    y = np.concatenate([_edge_angles(), (rng.random(20000) * 200).astype(np.float32),
                        ((rng.random(5000) - 0.5) * 2e6).astype(np.float32)])
    cos = np.array([lib.cosf(float(v)) for v in y], np.float32)
    sin = np.array([lib.sinf(float(v)) for v in y], np.float32)
    np.testing.assert_array_equal(libm_sincos.cosf(y), cos)
    np.testing.assert_array_equal(libm_sincos.sinf(y), sin)


def test_released_dims_take_sleef_powf_on_the_vector_body():
    """rope_head_dim >= 64: torch's `base ** exps` runs SLEEF powf_u10 on the first multiple of 32 exponents
    (numerics/sleef_powf.py, checked against torch there); below 64 every element is glibc's (golden tables)."""
    from dsv41_jax.numerics import libm_powf, sleef_powf

    for dim, base in ((64, 1e4), (64, 1.6e5), (128, 5e5), (32, 1e4), (48, 2e4)):
        exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        got = rope.rope_frequencies(dim, base)
        np.testing.assert_array_equal(got, (np.float32(1) / sleef_powf.rope_pow(base, exps)).astype(np.float32))
        glibc = (np.float32(1) / libm_powf.powf(np.float32(base), exps)).astype(np.float32)
        if dim < 64:
            np.testing.assert_array_equal(got, glibc)
    # the switch matters somewhere in the released range (else this test could not tell the two apart)
    differs = [(d, b) for d in (64, 128) for b in (1e4, 1.6e5, 5e5, 1e6)
               if not np.array_equal(sleef_powf.rope_pow(b, np.arange(0, d, 2, dtype=np.float32) / np.float32(d)),
                                     libm_powf.powf(np.float32(b), np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))]
    assert differs


# ------------------------------------------------------------------------------------- slow: torch
def _torch_precompute_freqs_cis(torch, dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow):
    """The reference's `precompute_freqs_cis`, statement by statement. One adaptation: the oracle's
    AVX512 torch runs `base ** exps` for fewer than 32 exponents on its scalar path (glibc powf);
    an AVX2 host would vectorise 16 of them, so the exponents are made non-contiguous here, which
    sends every element down that scalar path on any host."""
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    exps = torch.stack([exps, exps], -1)[:, 0]  # same values, stride 2
    freqs = 1.0 / (base ** exps)
    if original_seq_len > 0:
        def corrected_dim(rotations):
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    freqs = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def _sweep():
    rng = np.random.default_rng(2026)
    cases = [(32, 1e4, 0, 1.0, 32, 1), (32, 2e4, 0, 1.0, 32, 1), (32, 1.6e5, 64, 16.0, 32, 1),
             (32, 2e4, 64, 16.0, 32, 1), (16, 5e5, 128, 40.0, 32, 1), (48, 1e6, 4096, 40.0, 32, 1),
             (60, 4e4, 256, 4.0, 16, 2), (8, 1e4, 32, 2.5, 8, 1), (32, 1e4, 16, 8.0, 64, 4)]
    for _ in range(40):
        dim = int(rng.choice([8, 12, 16, 24, 32, 40, 48, 56, 62]))
        base = float(rng.choice([1e4, 2e4, 4e4, 1.6e5, 1e6])) * float(rng.uniform(0.5, 2.0))
        osl = int(rng.choice([0, 16, 64, 100, 1024, 8192]))
        factor = float(rng.choice([1.0, 2.5, 4.0, 16.0, 40.0]))
        bf, bs = int(rng.choice([8, 16, 32, 64])), int(rng.choice([1, 2, 4]))
        cases.append((dim, base, osl, factor, bf, bs))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("dim,base,osl,factor,beta_fast,beta_slow", _sweep())
def test_tables_equal_torch_precompute_freqs_cis(dim, base, osl, factor, beta_fast, beta_slow):
    torch = pytest.importorskip("torch", reason="the reference formula runs in torch (pip install torch==2.14.1)")
    rows = 2048
    ref = _torch_precompute_freqs_cis(torch, dim, rows, osl, base, factor, beta_fast, beta_slow)
    got = rope.rope_table(dim, rows, base, osl, factor, beta_fast, beta_slow)
    np.testing.assert_array_equal(got.cos.view(np.uint32), ref.real.contiguous().numpy().view(np.uint32))
    np.testing.assert_array_equal(got.sin.view(np.uint32), ref.imag.contiguous().numpy().view(np.uint32))


@pytest.mark.slow
def test_sincos_equals_torch_polar_on_ten_million_inputs():
    torch = pytest.importorskip("torch", reason="torch.polar is the oracle (pip install torch==2.14.1)")
    rng = np.random.default_rng(11)
    total = 0
    for chunk in range(10):
        scale = [130.0, 4096.0, 1e6, 2.0, 1e30][chunk % 5]
        y = ((rng.random(1_000_000) - (0.5 if chunk % 2 else 0.0)) * scale).astype(np.float32)
        if chunk == 0:
            y = np.concatenate([_edge_angles(), y])
        ref = torch.polar(torch.ones(len(y)), torch.from_numpy(y))
        np.testing.assert_array_equal(libm_sincos.cosf(y).view(np.uint32), ref.real.contiguous().numpy().view(np.uint32))
        np.testing.assert_array_equal(libm_sincos.sinf(y).view(np.uint32), ref.imag.contiguous().numpy().view(np.uint32))
        total += len(y)
    assert total >= 10_000_000

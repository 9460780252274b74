"""Every emulated elementwise function against torch 2.14.1's CPU kernels, on 10^7 inputs each (slow).

torch picks SLEEF (vector body) or glibc (scalar path) per element (docs/NUMERICS.md, "torch's
vector body and scalar tail"). Contiguous inputs whose length is a multiple of 32 run entirely in
the vector body on AVX2 and AVX512 alike; a stride-2 view runs entirely on the scalar path. Each
path is compared with the emulation the model uses for it. The split itself (which elements of a
call take which path on the oracle's AVX512 machine) is checked against the oracle's own DSpark
traces in tests/layers/test_mhc_sinkhorn.py and as a unit below.

torch.exp and torch.sqrt are not compared here: they are MKL VML kernels in torch, and the
reference reaches exp only through sigmoid/silu/softplus/softmax (SLEEF or glibc, compared here).
MKL's sqrt has its own sweep (tests/numerics/test_mkl_sqrt.py).
"""
import ctypes
import ctypes.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.numerics import activations
from dsv41_jax.numerics.exact_ops import exact_sqrt, true_divide
from dsv41_jax.numerics.glibc_expf import expf_glibc
from dsv41_jax.numerics.sleef_exp import log1pf_u10
from dsv41_jax.numerics.torch_loops import scalar_tail_mask

N_TOTAL = 10_000_000
CHUNK = 1 << 20  # a multiple of 32: every element of a contiguous chunk is in torch's vector body
EDGES = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 0.5, -0.5, 1.0, -1.0, 15.9, 16.0, 16.1, 19.99, 20.0, 20.01,
                  -20.0, 30.0, -30.0, 80.0, -80.0, 87.0, -87.0, 88.7, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan],
                 np.float32)


def _inputs(seed: int, lo: float, hi: float, edges=EDGES):
    """Chunks of uniform values in [lo, hi], the edge values spliced into the first one."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < N_TOTAL:
        x = rng.uniform(lo, hi, CHUNK).astype(np.float32)
        if done == 0:
            x[:len(edges)] = edges
        yield x
        done += CHUNK


def _same_bits(ours, ref, name):
    ours, ref = np.asarray(ours), np.asarray(ref)
    bad = (ours.view(np.uint32) != ref.view(np.uint32)) & ~(np.isnan(ours) & np.isnan(ref))
    assert not bad.any(), f"{name}: {int(bad.sum())} differ, e.g. x at {np.nonzero(bad)[0][:5]}"


def _scalar_view(torch, x):
    """The same values as a stride-2 view: torch's scalar lambda computes every element."""
    t = torch.from_numpy(x)
    return torch.stack([t, t], -1)[:, 0]


def _torch():
    return pytest.importorskip("torch", reason="torch CPU is the oracle here (pip install torch==2.14.1)")


ONE = jnp.float32(1.0)
# Domain notes for the edge values: XLA's CPU backend flushes float32 subnormals to zero, so
# softplus below x = -80 (exp(x) near 2^-126 then an x / (2 + x) step in log1p) is outside what it
# can represent; the model only reaches those values inside sums with a term >= 1, where they
# vanish. log1p is reached only through softplus, whose argument exp(min(x, 20)) is below 5e8.
_SOFTPLUS_EDGES = EDGES[~(EDGES < -80.0)]
_LOG1P_EDGES = EDGES[~(np.abs(EDGES) > 1e30)]
# (name, input range, our vector-body emulation, torch op, our scalar-path emulation or None)
CASES = [
    ("sigmoid", (-40.0, 40.0), lambda x: activations.sigmoid(x, "exact"), "sigmoid",
     lambda x: true_divide(ONE, ONE + expf_glibc(-x))),
    ("silu", (-40.0, 40.0), lambda x: activations.silu(x, "exact"), "silu",
     lambda x: true_divide(x, ONE + expf_glibc(-x))),
    ("softplus", (-40.0, 40.0), lambda x: activations.softplus(x, "exact"), "softplus", activations.softplus_scalar),
    # torch.log1p itself vectorises strided views too (SLEEF on gathered lanes), so it has no
    # glibc path to compare; softplus's scalar lambda calls glibc log1pf (checked above, and
    # against the C library in tests/numerics/test_glibc_log1pf.py)
    ("log1p", (-0.99, 5e8), log1pf_u10, "log1p", None),
    ("rsqrt", (1e-6, 1e4), lambda x: true_divide(ONE, exact_sqrt(x)), "rsqrt", None),  # layers/basic.inv_sqrt
]


@pytest.mark.slow
@pytest.mark.parametrize("name,rng_range,vector_fn,torch_op,scalar_fn", CASES, ids=[c[0] for c in CASES])
def test_against_torch_cpu(name, rng_range, vector_fn, torch_op, scalar_fn):
    torch = _torch()
    import torch.nn.functional as F

    op = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "log1p": torch.log1p,
          "rsqrt": torch.rsqrt}[torch_op]
    with jax.enable_x64(True):
        vec = jax.jit(vector_fn)
        sca = jax.jit(scalar_fn) if scalar_fn is not None else None
        n = 0
        edges = {"softplus": _SOFTPLUS_EDGES, "log1p": _LOG1P_EDGES}.get(name, EDGES)
        for i, x in enumerate(_inputs(sum(map(ord, name)), *rng_range, edges=edges)):
            _same_bits(vec(x), op(torch.from_numpy(x)).numpy(), f"{name} vector body, chunk {i}")
            if sca is not None:
                _same_bits(sca(x), op(_scalar_view(torch, x)).contiguous().numpy(), f"{name} scalar path, chunk {i}")
            n += len(x)
    assert n >= N_TOTAL


@pytest.mark.slow
def test_true_division_against_torch():
    torch = _torch()
    rng = np.random.default_rng(5)
    div = jax.jit(true_divide)
    for i in range(N_TOTAL // CHUNK + 1):
        a = (rng.standard_normal(CHUNK) * np.float32(10.0) ** rng.integers(-8, 8, CHUNK)).astype(np.float32)
        b = (rng.standard_normal(CHUNK) * np.float32(10.0) ** rng.integers(-8, 8, CHUNK)).astype(np.float32)
        if i == 0:
            a[:len(EDGES)], b[:len(EDGES)] = EDGES, EDGES[::-1]
        _same_bits(div(a, b), (torch.from_numpy(a) / torch.from_numpy(b)).numpy(), f"division chunk {i}")


@pytest.mark.slow
def test_glibc_expf_against_the_c_library():
    name = ctypes.util.find_library("m")
    if not sys.platform.startswith("linux") or name is None:
        pytest.skip("needs glibc's libm")
    lib = ctypes.CDLL(name)
    lib.expf.restype, lib.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    rng = np.random.default_rng(9)
    # normal range only: XLA's CPU backend flushes float32 subnormals (results below 2^-126, for
    # x < -87.3) to zero; 1 + exp(-x) never sees them
    x = np.concatenate([rng.uniform(-87.0, 88.7, 400_000).astype(np.float32), EDGES[np.abs(EDGES) < 87.3]])
    ref = np.array([lib.expf(float(v)) for v in x], np.float32)
    with jax.enable_x64(True):
        _same_bits(jax.jit(expf_glibc)(x), ref, "glibc expf")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sigmoid", "softplus"])
def test_every_vector_width_remainder_against_torch(name):
    """Calls of every length 1..130 (every remainder mod 32 and mod 16, four full steps), 64 calls
    per length: the body/tail composition (`with_scalar_tail`) equals torch's contiguous call
    element for element. Rows of a [64, n] array with tail_dims=1 are 64 separate calls; an
    [n / 8, 8] call with tail_dims=2 is the same contiguous tensor to torch (the gate's
    [T, experts])."""
    torch = _torch()
    ours_fn, ref_fn = {"sigmoid": (activations.sigmoid, torch.sigmoid),
                       "softplus": (activations.softplus, torch.nn.functional.softplus)}[name]
    rng = np.random.default_rng(17)
    total = 0
    with jax.enable_x64(True):
        for n in range(1, 131):
            x = rng.uniform(-25.0, 25.0, (64, n)).astype(np.float32)
            x[0, :min(n, len(_SOFTPLUS_EDGES))] = _SOFTPLUS_EDGES[:n]
            ours = np.asarray(jax.jit(lambda v: ours_fn(v, "exact", tail_dims=1))(x))
            ref = np.stack([ref_fn(torch.from_numpy(row.copy())).numpy() for row in x])
            _same_bits(ours, ref, f"{name} contiguous length {n}")
            total += x.size
            if n % 8 == 0:
                ours = np.asarray(jax.jit(lambda v: ours_fn(v, "exact", tail_dims=2))(x[1].reshape(-1, 8)))
                _same_bits(ours.reshape(-1), ref[1], f"{name} [{n // 8}, 8]")
    assert total > 5 * 10 ** 5


def test_scalar_tail_mask_follows_the_avx512_loop():
    """N contiguous elements: the first 32 * floor(N / 32) vectorised, the rest scalar."""
    m = scalar_tail_mask((2, 97, 4), 2)
    assert m.shape == (2, 97, 4)
    assert not m[:, :96].any() and m[:, 96].all()  # 388 = 12 * 32 + 4: the last token's 4
    assert scalar_tail_mask((1, 1, 4), 2).all()  # decode: all scalar
    assert not scalar_tail_mask((40, 4), 2).any()  # 160 = 5 * 32
    assert scalar_tail_mask((9, 4), 2).sum() == 4  # the Sinkhorn vectors: row 8
    with pytest.raises(ValueError, match="block_dims"):
        scalar_tail_mask((4,), 2)

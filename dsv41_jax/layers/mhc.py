"""Manifold-constrained hyper-connections: splitting the 24 mixes into pre / post / comb (docs/REFERENCE.md §3).

`sinkhorn_split` reproduces the golden oracle's ``hc_split_sinkhorn`` (golden README, oracle
choice 1) bit for bit on its kernel vectors, which requires mirroring torch's CPU float32
arithmetic exactly:
  * sigmoid(z) = 1 / (1 + exp(-z)) and softmax = exp(z - max) * (1 / sum), with torch's CPU exp
    (SLEEF expf_u10, see `sleef_exp`); with ``exp_impl="xla"`` ~1 % of exps are 1 ulp off;
  * torch.sigmoid's scalar tail: the coefficients of the last T mod 8 tokens of a call (all of
    them in decode) come from glibc's expf, not SLEEF's (``exp_impl="torch"``, what exact mode
    uses; it needs 64-bit types). Without it ``post`` and ``pre`` were 1 ulp off on ~4 % of those;
  * every normalisation is a true IEEE division (XLA would otherwise turn x / broadcast(s) into
    x * (1/s)); sums over 4 entries run left to right; multiply-then-add is never fused into an
    FMA (XLA contracts those under jit).
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.exact_ops import no_fma, sum_in_order, true_divide
from dsv41_jax.numerics.glibc_expf import expf_glibc
from dsv41_jax.numerics.sleef_exp import expf_u10
from dsv41_jax.numerics.torch_loops import scalar_tail_mask

EXP_IMPLS = ("torch", "sleef", "xla")

# Cost accounting (serving/cost.py) lowers steps with the Sinkhorn rounds unrolled: XLA's cost
# analysis counts a loop body once, whatever its trip count. Trace-time only; same ops either way.
_UNROLL_SINKHORN = contextvars.ContextVar("unroll_sinkhorn", default=False)


@contextlib.contextmanager
def unrolled_sinkhorn():
    """Within it, programs traced write the Sinkhorn rounds out (no `while` in the lowered module)."""
    token = _UNROLL_SINKHORN.set(True)
    try:
        yield
    finally:
        _UNROLL_SINKHORN.reset(token)


def _exp(x: jax.Array, exp_impl: str) -> jax.Array:
    if exp_impl in ("sleef", "torch"):
        return expf_u10(x)
    if exp_impl == "xla":
        return jnp.exp(x)
    raise ValueError(f"exp_impl must be one of {EXP_IMPLS}, got {exp_impl!r}")


def _exp_parts(parts: tuple, exp_impl: str, exp=None) -> list:
    """exp of each array in `parts` (equal leading dims) through one call on their concatenation:
    the same bits as one call each (elementwise), and one copy of the exp's ~300 operations in the
    program instead of one per part (three per site were over half of a fast-mode step's program)."""
    lead = parts[0].shape[:-1]
    flat = [p.reshape(*lead, -1) for p in parts]
    out = (exp or (lambda v: _exp(v, exp_impl)))(jnp.concatenate(flat, axis=-1))
    cuts = [0]
    for f in flat:
        cuts.append(cuts[-1] + f.shape[-1])
    return [out[..., a:b].reshape(p.shape) for a, b, p in zip(cuts, cuts[1:], parts)]


def _sigmoids(zs: tuple, exp_impl: str, exps: list) -> list:
    """1 / (1 + exp(-z)) for each z of `zs` (equal shapes), given `exps` = exp(-z). "torch": the
    oracle's `torch.sigmoid` on the contiguous [T, hc] block of one call: SLEEF exp in the vector
    body, glibc expf in the scalar tail (numerics/torch_loops)."""
    one = jnp.float32(1.0)
    bodies = [one / (one + e) for e in exps]
    if exp_impl != "torch":
        return bodies
    tail = scalar_tail_mask(zs[0].shape, min(2, zs[0].ndim))
    if not tail.any():
        return bodies
    tails = _exp_parts(tuple(-z for z in zs), exp_impl, exp=expf_glibc)
    return [jnp.where(tail, one / (one + t), b) for t, b in zip(tails, bodies)]


def sinkhorn_split(
    mixes: jax.Array,
    hc_scale: jax.Array,
    hc_base: jax.Array,
    hc_mult: int,
    iters: int,
    eps: float,
    *,
    exp_impl: str = "sleef",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split mHC mixes [..., (2+hc)*hc] into pre [..., hc], post [..., hc], comb [..., hc, hc].

    pre = sigmoid(s0*m + b) + eps; post = 2*sigmoid(s1*m + b); comb = row softmax of the
    hc x hc logits (row-major), + eps, column-normalised, then (iters - 1) x (row, column)
    normalisation, each dividing by (sum + eps). comb[j, k]: j is the source copy (the output is
    X'_k = post_k F(u) + sum_j comb[j, k] X_j). All float32.
    """
    hc = int(hc_mult)
    n_mix = (2 + hc) * hc
    if mixes.shape[-1] != n_mix:
        raise ValueError(
            f"sinkhorn_split: mixes last dim is {mixes.shape[-1]}, expected (2+hc)*hc = {n_mix} "
            f"for hc_mult={hc}"
        )
    if tuple(hc_scale.shape) != (3,) or tuple(hc_base.shape) != (n_mix,):
        raise ValueError(
            f"sinkhorn_split: hc_scale must be [3] and hc_base [{n_mix}], got "
            f"{tuple(hc_scale.shape)} and {tuple(hc_base.shape)}"
        )
    if iters < 1:
        raise ValueError(f"sinkhorn_split: iters must be >= 1, got {iters}")
    f32 = jnp.float32
    m = mixes.astype(f32)
    scale = hc_scale.astype(f32)
    base = hc_base.astype(f32)
    eps = f32(eps)
    one = f32(1.0)

    def affine(part, k):  # torch: one multiply, then one add (never fused)
        return no_fma(part * scale[k]) + base[sl[k]]

    sl = (slice(0, hc), slice(hc, 2 * hc), slice(2 * hc, n_mix))
    z_pre, z_post = affine(m[..., sl[0]], 0), affine(m[..., sl[1]], 1)
    logits = affine(m[..., sl[2]], 2).reshape(*m.shape[:-1], hc, hc)
    # the two sigmoids' exps and the softmax's exp in one call (`_exp_parts`)
    e_pre, e_post, e = _exp_parts((-z_pre, -z_post, logits - jnp.max(logits, axis=-1, keepdims=True)), exp_impl)
    s_pre, s_post = _sigmoids((z_pre, z_post), exp_impl, [e_pre, e_post])
    pre = s_pre + eps
    post = f32(2.0) * s_post

    comb = no_fma(e * (one / sum_in_order(e, -1))) + eps
    comb = true_divide(comb, sum_in_order(comb, -2) + eps)
    def normalise(_, c):  # one (row, column) round
        c = true_divide(c, sum_in_order(c, -1) + eps)
        return true_divide(c, sum_in_order(c, -2) + eps)

    # A loop, not an unrolled chain: one body in the program instead of iters - 1 copies in every
    # layer's two sites (compile time), bit-identical to the unrolled rounds (tests/layers/test_mhc_sinkhorn.py).
    comb = jax.lax.fori_loop(0, iters - 1, normalise, comb, unroll=True if _UNROLL_SINKHORN.get() else 1)
    return pre, post, comb

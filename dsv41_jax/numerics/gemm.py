"""Linear layers with dense, FP8 or FP4 weights, in two numerics modes.

``mode="exact"`` mirrors the golden oracle (golden README, oracle choices 1 and 2): every dot
product is computed exactly in float64 and rounded once; the FP8/FP4 GEMMs sum per-32-block
partial products in float32, block by block in K order, then cast. It needs float64, so it must run
under ``with jax.enable_x64(True):`` on CPU or GPU (TPUs have no float64).

``mode="fast"`` is the production path: quantise the activation exactly as the oracle does,
dequantise activation and weight (both exact in bf16: E4M3/E2M1 times a power of two), and run one
dot with float32 accumulation. It differs from exact mode only by accumulation rounding.

In both modes the activation of an FP8/FP4 GEMM is quantised with `quant_fp8_act` (E4M3, E8M0 scale
per 32), as the reference's `linear()` does for either weight format.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import quant

BLOCK = 32
# bytes of float64 block dots one exact-mode GEMM step may hold: rows go in chunks below it (at the
# released width one [520 x 5120] x [2048 x 5120] expert GEMM would hold 1.4 GB of them at once)
EXACT_CHUNK_BYTES = 1 << 29
KINDS = ("dense", "fp8", "fp4")
MODES = ("fast", "exact")


# The FP8 block GEMM kernel for fast-mode FP8 linears, set while the layer body traces a plan
# with impl "pallas" (`fp8_kernel`); None runs the XLA math below, which dequantizes the whole
# weight on every call. A trace-time switch (as `mhc.unrolled_sinkhorn`) rather than an argument:
# every QLinear call site of the body would otherwise thread the plan's kernel choice through.
_FP8_KERNEL: contextvars.ContextVar = contextvars.ContextVar("fp8_kernel", default=None)


@contextlib.contextmanager
def fp8_kernel(fn):
    """While tracing inside, fast-mode FP8 linears run ``fn(x2 [M, K], weight, scale) -> f32 [M, N]``
    (e.g. `pallas_kernels.fp8_block_gemm` with impl "pallas"), which reads the stored E4M3 tiles and
    dequantizes them inside the kernel. Exact mode never uses it: the kernel has no exact mode."""
    token = _FP8_KERNEL.set(fn)
    try:
        yield
    finally:
        _FP8_KERNEL.reset(token)


def _require_x64() -> None:
    if jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64:
        raise RuntimeError(
            "linear(mode='exact') computes dots in float64, but 64-bit types are disabled; "
            "wrap the call in `with jax.enable_x64(True):` (or use mode='fast')"
        )


def _round_to(y: jax.Array, dtype) -> jax.Array:
    """f64 -> dtype via float32, the path torch's (and XLA's) conversion takes."""
    return y.astype(jnp.float32).astype(dtype)


def _sum_blocks_in_order(terms: jax.Array) -> jax.Array:
    """Float32 sum over the last axis, strictly left to right (a reduce may reassociate)."""
    terms = jnp.moveaxis(terms, -1, 0)

    def step(acc, term):
        return acc + term, None

    acc, _ = jax.lax.scan(step, jnp.zeros(terms.shape[1:], jnp.float32), terms)
    return acc


def _quantised_activation(x2: jax.Array, k_padded: int) -> tuple[jax.Array, jax.Array]:
    """Zero-pad K to whole blocks (zeros never change a block's amax) and quantise to FP8."""
    pad = k_padded - x2.shape[-1]
    if pad:
        x2 = jnp.pad(x2, ((0, 0), (0, pad)))
    return quant.quant_fp8_act(x2, BLOCK)


def _check_fp8(weight, scale, n: int, k: int) -> None:
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    if weight.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"linear(kind='fp8'): weight must be float8_e4m3fn, got {weight.dtype}")
    if scale is None or tuple(scale.shape) != (nb, kb):
        got = None if scale is None else tuple(scale.shape)
        raise ValueError(
            f"linear(kind='fp8'): weight {tuple(weight.shape)} needs an E8M0 scale of shape "
            f"({nb}, {kb}) (one per 32x32 tile), got {got}"
        )


def _weight_fp8(weight, scale, n: int, k: int):
    """E4M3 weight values zero-padded to whole K blocks, and per-(row, K block) f32 scales."""
    _check_fp8(weight, scale, n, k)
    kb = -(-k // BLOCK)
    values = jnp.pad(weight.astype(jnp.float32), ((0, 0), (0, kb * BLOCK - k)))
    row_scale = jnp.repeat(quant.e8m0_to_float(scale), BLOCK, axis=0)[:n]
    return values, row_scale


def _weight_fp4(weight, scale, n: int, k: int):
    """E2M1 weight values [N, K] and per-(row, K block) f32 scales."""
    if weight.dtype != jnp.uint8:
        raise TypeError(f"linear(kind='fp4'): packed weight must be uint8, got {weight.dtype}")
    if k % BLOCK:
        raise ValueError(f"linear(kind='fp4'): K = {k} must be a multiple of {BLOCK}")
    if scale is None or tuple(scale.shape) != (n, k // BLOCK):
        got = None if scale is None else tuple(scale.shape)
        raise ValueError(
            f"linear(kind='fp4'): packed weight {tuple(weight.shape)} needs an E8M0 scale of shape "
            f"({n}, {k // BLOCK}), got {got}"
        )
    values = quant.e2m1_decode(quant.unpack_fp4(weight))
    return values, quant.e8m0_to_float(scale)


def _quantised_linear(x2, weight, scale, kind: str, mode: str, out_dtype):
    m, k = x2.shape
    n = weight.shape[0]
    if kind == "fp8":
        w_vals, w_scale = _weight_fp8(weight, scale, n, k)
    else:
        w_vals, w_scale = _weight_fp4(weight, scale, n, k)
    kb = w_scale.shape[1]
    a_q, a_scale_b = _quantised_activation(x2, kb * BLOCK)
    a_vals, a_scale = a_q.astype(jnp.float32), quant.e8m0_to_float(a_scale_b)

    if mode == "fast":
        a_deq = (a_vals.reshape(m, kb, BLOCK) * a_scale[..., None]).reshape(m, kb * BLOCK)
        w_deq = (w_vals.reshape(n, kb, BLOCK) * w_scale[..., None]).reshape(n, kb * BLOCK)
        # both are exact in bf16 (<= 4 significant bits times a power of two)
        y = jnp.dot(
            a_deq.astype(jnp.bfloat16), w_deq.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32
        )
        return y.astype(out_dtype)

    _require_x64()
    return _exact_block_gemm(a_vals, a_scale, w_vals, w_scale).astype(out_dtype)


def _exact_block_gemm(a_vals, a_scale, w_vals, w_scale):
    """Exact mode's block GEMM, f32 [M, N], in chunks of rows whose float64 block dots fit
    EXACT_CHUNK_BYTES (`lax.map`, one chunk at a time). Each row's result depends on that row only
    (its own activation scales, exact block dots, its own in-order sum), so chunks change no bit."""
    m, n, kb = a_vals.shape[0], w_vals.shape[0], w_scale.shape[1]
    w64 = w_vals.astype(jnp.float64).reshape(n, kb, BLOCK)

    def rows(a, s):
        a64 = a.astype(jnp.float64).reshape(a.shape[0], kb, BLOCK)
        # exact: <= 8-bit products spanning < 2^41, 32 of them, fit float64's 53 bits in any order
        block_dots = jnp.einsum("mkb,nkb->mnk", a64, w64).astype(jnp.float32)
        terms = block_dots * s[:, None, :] * w_scale[None, :, :]
        return _sum_blocks_in_order(terms)

    per_chunk = max(1, EXACT_CHUNK_BYTES // (n * kb * 8))
    if m <= per_chunk:
        return rows(a_vals, a_scale)
    chunks = -(-m // per_chunk)
    pad = ((0, chunks * per_chunk - m), (0, 0))  # zero rows (zero scales): their sums are dropped
    a = jnp.pad(a_vals, pad).reshape(chunks, per_chunk, -1)
    s = jnp.pad(a_scale, pad).reshape(chunks, per_chunk, -1)
    return jax.lax.map(lambda c: rows(*c), (a, s)).reshape(chunks * per_chunk, n)[:m]


def linear(
    x: jax.Array,
    weight: jax.Array,
    scale: jax.Array | None = None,
    *,
    kind: str,
    mode: str = "fast",
    out_dtype=None,
) -> jax.Array:
    """y = x @ W.T for a dense, FP8 (32x32 E8M0 tiles) or FP4 (E8M0 per 32 along K) weight.

    x: [..., K] bf16/f32.  weight: dense [N, K]; fp8 float8_e4m3fn [N, K] + scale uint8
    [ceil(N/32), ceil(K/32)]; fp4 packed uint8 [N, K/2] + scale uint8 [N, K/32].
    The output dtype defaults to x.dtype (the reference returns torch's default dtype, which is
    the activation dtype in every call site).
    """
    if kind not in KINDS:
        raise ValueError(f"linear: kind must be one of {KINDS}, got {kind!r}")
    if mode not in MODES:
        raise ValueError(f"linear: mode must be one of {MODES}, got {mode!r}")
    x = jnp.asarray(x)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if kind == "fp8" and weight.dtype == jnp.int32:
        return _linear_words(x, weight, scale, mode, out_dtype)
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    k_weight = weight.shape[1] * (2 if kind == "fp4" else 1)
    if x.shape[-1] != k_weight:
        raise ValueError(
            f"linear(kind={kind!r}): x has K = {x.shape[-1]} but the weight {tuple(weight.shape)} "
            f"expects K = {k_weight}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])

    if kind == "dense":
        if scale is not None:
            raise ValueError("linear(kind='dense') takes no scale; pass kind='fp8' or 'fp4'")
        if mode == "exact":
            _require_x64()
            y = _round_to(jnp.dot(x2.astype(jnp.float64), weight.astype(jnp.float64).T), out_dtype)
        else:
            dtype = jnp.promote_types(x2.dtype, weight.dtype)
            y = jnp.dot(
                x2.astype(dtype),
                weight.astype(dtype).T,
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            ).astype(out_dtype)
    elif kind == "fp8" and mode == "fast" and _FP8_KERNEL.get() is not None:
        _check_fp8(weight, scale, weight.shape[0], x2.shape[-1])  # the XLA path's checks and messages
        y = _FP8_KERNEL.get()(x2, weight, scale).astype(out_dtype)
    else:
        y = _quantised_linear(x2, weight, scale, kind, mode, out_dtype)
    return y.reshape(*lead, y.shape[-1])


def _linear_words(x, words, scale, mode: str, out_dtype):
    """An FP8 linear whose weight is the kernel's int32 word view [2, N, Kp/8]
    (`pallas_kernels.expert_gemm.layout.fp8_weight_view`, made once by
    `dsv41_jax.model.kernel_weights.kernel_params` for a plan that runs the FP8 kernel): only the kernel reads it."""
    fn = _FP8_KERNEL.get()
    if mode != "fast" or fn is None:
        raise ValueError(
            f"linear(kind='fp8'): the weight is the FP8 kernel's int32 word view {tuple(words.shape)}, but this call "
            f"runs {'exact mode' if mode != 'fast' else 'without the FP8 kernel (no gemm.fp8_kernel context)'}; "
            f"params prepared by dsv41_jax.model.kernel_weights.kernel_params(graphdef, params, plan) only serve that plan "
            f"(fast numerics, fp8_kernel): run the stored params otherwise")
    k = x.shape[-1]
    if words.ndim != 3 or words.shape[0] != 2 or 8 * words.shape[2] != -(-k // BLOCK) * BLOCK:
        raise ValueError(f"linear(kind='fp8'): x has K = {k} but the word-view weight {tuple(words.shape)} expects "
                         f"[2, N, {-(-k // BLOCK) * BLOCK // 8}]")
    n = words.shape[1]
    if scale is None or tuple(scale.shape) != (-(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"linear(kind='fp8'): word-view weight {tuple(words.shape)} needs an E8M0 scale of shape "
                         f"({-(-n // BLOCK)}, {-(-k // BLOCK)}), got {None if scale is None else tuple(scale.shape)}")
    lead = x.shape[:-1]
    y = fn(x.reshape(-1, k), words, scale).astype(jnp.dtype(out_dtype or x.dtype))
    return y.reshape(*lead, n)

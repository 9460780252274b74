"""The training model: the served architecture on fp32 master weights, with QAT at every GEMM.

The served modules compute on stored FP8/FP4 weights, which have no gradient. Training builds
the same model from the dense (`dtype="bf16"`) config and swaps three module kinds for
subclasses that reproduce the served numerics on dense weights:
  * `QATLinear` for every Linear the checkpoint stores in FP8: its input is fake-quantized to
    E4M3 with an E8M0 scale per 32 (as the served GEMM does), with a straight-through gradient;
  * `QATExperts` for the routed experts (MXFP4 or FP8 on the checkpoint), likewise;
  * `QATEngram` for the Engram table, held as fp32 rows and fake-quantized per looked-up row.
The weights themselves are fake-quantized by `weight_quant.qat_view` before the forward, so
the module code is the served code and the parameter paths are the served paths.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.basic import matmul, mean_square, QLinear
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.mhc import sinkhorn_split
from dsv41_jax.layers.mhc_site import HyperSite
from dsv41_jax.layers.moe import Experts
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.numerics import quant
from dsv41_jax.numerics.exact_ops import sum_in_order, true_divide
from dsv41_jax.train.params import flatten_state, Format, FP4_WEIGHT, FP8_ROWS, FP8_WEIGHT, path_key

_BLOCK = 32
# XLA options for programs that run once (init, import/export): compile fast, run slower
ONE_SHOT_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fake_act(x: jax.Array) -> jax.Array:
    """FP8 activation round trip per 32 (straight-through), zero-padding K like the served GEMM."""
    pad = -x.shape[-1] % _BLOCK
    if not pad:
        return quant.fake_fp8_act(x, _BLOCK)
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return quant.fake_fp8_act(xp, _BLOCK)[..., : x.shape[-1]]


def qat_matmul(x: jax.Array, w: jax.Array, act_quant: bool, out_dtype) -> jax.Array:
    """y = Q8(x) @ w.T in bf16 with fp32 accumulation: the served FP8/FP4 GEMM's fast path
    (gemm.linear) on a weight that already holds its storage values."""
    xq = fake_act(x) if act_quant else x
    y = jnp.einsum("...k,nk->...n", xq.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


class QATLinear(QLinear):
    """A served-FP8 Linear on a dense weight (why: see the module docstring)."""

    def __init__(self, src: QLinear, act_quant: bool):
        self.in_features, self.out_features, self.kind = src.in_features, src.out_features, "dense"
        self.weight, self.scale = src.weight, None
        self.act_quant = act_quant

    def __call__(self, x, mode: str = "fast", out_dtype=None):
        if mode != "fast":
            raise ValueError(f"QATLinear runs the fast numerics only, got mode={mode!r}")
        return qat_matmul(x, self.weight[...], self.act_quant, out_dtype or x.dtype)


class QATExperts(Experts):
    """Routed experts on dense stacked weights, with the served activation quantization."""

    def __init__(self, src: Experts, act_quant: bool):
        self.limit = src.limit
        self.w1, self.w2, self.w3 = src.w1, src.w2, src.w3
        self.w1_scale = self.w2_scale = self.w3_scale = None
        # the parent's grouped path fake-quantizes activations iff kind != "dense"
        self.kind = "qat" if act_quant else "dense"

    def _lin(self, x, w, s, mode):
        return qat_matmul(x, w, self.kind != "dense", x.dtype)

    def dense_weights(self, which=None):
        take = (lambda a: a[...]) if which is None else (lambda a: a[...][which])
        return tuple(take(w).astype(jnp.bfloat16) for w in (self.w1, self.w2, self.w3))


class QATEngram(Engram):
    """Engram with an fp32 master table; looked-up rows take the served FP8 per-32 round trip."""

    def __init__(self, src: Engram, table: jax.Array, quant_rows: bool):
        self.hc, self.dim, self.eps, self.head_dim = src.hc, src.dim, src.eps, src.head_dim
        self.embed = nnx.Param(table)
        self.embed_scale = None
        self.wkv, self.q_weight, self.k_weight = src.wkv, src.q_weight, src.k_weight
        self.quant_rows = quant_rows

    def lookup(self, ids: jax.Array) -> jax.Array:
        rows = self.embed[...][ids]
        if self.quant_rows:
            rows = quant.fake_fp8_act(rows, 32)
        return rows.astype(jnp.bfloat16).reshape(*ids.shape[:-1], -1)


class LoopedHyperSite(HyperSite):
    """mHC site for training: Sinkhorn iterations 2..n in a `fori_loop`, and XLA's exp.

    Why: the served site unrolls all (20) iterations and evaluates exp with the torch-exact
    SLEEF polynomial; with their gradients these dominate the training step's compile time.
    The loop repeats the served row/column normalisations (docs/REFERENCE.md §3 mHC; mhc.sinkhorn_split),
    so values are unchanged; XLA's exp differs from SLEEF by <= 1 ulp in ~1% of calls, which
    training does not notice. exact_exp=True keeps SLEEF (the parity tests use it).
    """

    def __init__(self, src: HyperSite, exact_exp: bool = False):
        for k, v in vars(src).items():
            if not k.startswith("_"):
                setattr(self, k, v)
        self.total_iters, self.iters, self.exact_exp = src.iters, 1, exact_exp

    def mixes(self, h, mode):
        if self.exact_exp:
            pre, post, comb = super().mixes(h, mode)
        else:  # the served mixes (HyperSite.mixes) with exp_impl="xla"
            x = h.reshape(*h.shape[:-2], -1).astype(jnp.float32)
            rs = jax.lax.rsqrt(mean_square(x, mode) + jnp.float32(self.norm_eps))
            m = matmul(x, self.fn[...], "...k,mk->...m", jnp.float32, mode) * rs
            pre, post, comb = sinkhorn_split(m, self.scale[...], self.base[...], self.hc, 1, self.hc_eps, exp_impl="xla")
        eps = jnp.float32(self.hc_eps)

        def normalise(_, c):
            c = true_divide(c, sum_in_order(c, -1) + eps)
            return true_divide(c, sum_in_order(c, -2) + eps)

        return pre, post, jax.lax.fori_loop(0, self.total_iters - 1, normalise, comb)


def dense_config(cfg: ModelConfig) -> ModelConfig:
    """The same architecture with plain (unquantized) weights: the training model's skeleton."""
    return cfg.replace(dtype="bf16", expert_dtype=None)


def _set_child(model, path, new):
    parent = model
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def to_training_model(model, formats: dict[str, Format], *, act_quant: bool = True, quant_engram_rows: bool = True,
                      exact_mhc: bool = False):
    """Swap the modules of a dense-config Transformer for their QAT subclasses (in place).

    `formats` (from `params.serving_formats` of the checkpoint config) says which Linears are
    FP8 when served. exact_mhc keeps the served SLEEF exp in mHC (bitwise parity with serving;
    slower to compile). Returns the model; every float parameter becomes an fp32 master.
    """
    for path, m in list(nnx.iter_modules(model)):
        if isinstance(m, Engram) and not isinstance(m, QATEngram):
            table = quant.dequant_fp8_act(m.embed[...], m.embed_scale[...], 32)
            if formats.get(path_key(path + ("embed",)), Format(FP8_ROWS)).kind != FP8_ROWS:
                raise ValueError(f"{path_key(path)}: the serving Engram table is not FP8 rows")
            _set_child(model, path, QATEngram(m, table, quant_engram_rows))
        elif isinstance(m, HyperSite) and not isinstance(m, LoopedHyperSite):
            _set_child(model, path, LoopedHyperSite(m, exact_mhc))
        elif isinstance(m, Experts) and not isinstance(m, QATExperts):
            served = formats[path_key(path + ("w1",))].kind
            _set_child(model, path, QATExperts(m, act_quant and served in (FP8_WEIGHT, FP4_WEIGHT)))
    for path, m in list(nnx.iter_modules(model)):
        if type(m) is QLinear and formats[path_key(path + ("weight",))].kind in (FP8_WEIGHT, FP4_WEIGHT):
            _set_child(model, path, QATLinear(m, act_quant))
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        if jnp.issubdtype(value.dtype, jnp.floating) and value.dtype != jnp.float32:
            var.set_value(value.astype(jnp.float32))
    return model


def build_training_model(cfg: ModelConfig, formats: dict[str, Format], *, seed: int = 0, act_quant: bool = True,
                         quant_engram_rows: bool = True, exact_mhc: bool = False, abstract: bool = False,
                         engram_rows: tuple[int, ...] | None = None):
    """(graphdef, flat fp32 masters) of a freshly initialised training model.

    engram_rows: the Engram tables' row counts (default the config's; more rows than the config's are
    never looked up: a layout padding the tables to a multiple of their shards).

    The whole initialisation runs as one compiled program (eager init compiles once per
    parameter shape, which dominates start-up on CPU). abstract=True returns shapes only.
    """
    holder = {}

    def init():
        m = to_training_model(Transformer(dense_config(cfg), rngs=seed, engram_rows=engram_rows), formats, act_quant=act_quant,
                              quant_engram_rows=quant_engram_rows, exact_mhc=exact_mhc)
        holder["graphdef"], state = nnx.split(m)
        return flatten_state(state)

    shapes = jax.eval_shape(init)
    if abstract:
        return holder["graphdef"], shapes
    return holder["graphdef"], jax.jit(init, compiler_options=ONE_SHOT_COMPILE)()

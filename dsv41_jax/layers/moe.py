"""Mixture of experts: sqrt-softplus gate with a selection-only bias, 6 of N routed experts with
clamped SwiGLU, and a shared expert on every token (docs/REFERENCE.md §3 "MoE").

Routed expert weights are stacked [E, out, in] (packed MXFP4 on the checkpoint), so expert
parallelism and grouped GEMM kernels see one array per matrix.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import gemm, quant
from dsv41_jax.numerics.exact_ops import no_fma, torch_sum_last, true_divide
from dsv41_jax.numerics.activations import sigmoid, softplus, sqrt, swiglu
from dsv41_jax.layers.basic import QLinear, matmul, weight_kind


# exact mode: a call over this many tokens runs each expert's rows together (`Experts.per_expert`)
# rather than each row gathering its expert (`per_row`, cheaper for decode)
PER_ROW_TOKENS = 8
# fast numerics: routed rows (tokens x top-k) above which the sorted ragged path (`Experts.grouped`,
# the active experts dequantized once) is cheaper than each row gathering its expert (`per_row`)
GROUPED_ROWS = 256
# `ragged_dot`'s weight gradient over more than GROUP_PAD_ABOVE groups is computed for the groups padded
# to a multiple of GROUP_PAD (why: there)
GROUP_PAD, GROUP_PAD_ABOVE = 512, 128


@jax.custom_vjp
def ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(x [m, k], w [G, k, n], sizes [G])` in fp32, with jax's own gradients, except
    that the weight gradient over more than `GROUP_PAD_ABOVE` groups is computed for the groups padded
    with empty ones to a multiple of `GROUP_PAD` and cut back to G.

    Why: XLA:TPU (libtpu 0.0.42, v5p) fails to compile the weight gradient (a ragged dot contracting
    over the rows) for G = 384 experts, the released model's QAT step: "Bitcast cannot have different
    shape sizes", the group sizes s32[384] laid out in tiles of 512 bitcast to s32[384,1] in tiles of
    128. On one chip as on a mesh, even with the sizes an argument; 8, 128, 256 and 512 groups
    compile, 384 and 640 do not. Each group's
    gradient is the same dot over the same rows, so the values are those of jax's rule bit for bit; the
    tiny model's 8 experts compile as they are (and padding them would cost 64 times the CPU's dense
    expansion of the ragged dot)."""
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def _ragged_dot_fwd(x, w, sizes):
    return ragged_dot(x, w, sizes), (x, w, sizes)


def _ragged_dot_bwd(res, ct):
    x, w, sizes = res
    G = w.shape[0]
    padded = jnp.pad(sizes, (0, -G % GROUP_PAD if G > GROUP_PAD_ABOVE else 0))
    dot = lambda sz: lambda a, b: jax.lax.ragged_dot(a, b, sz, preferred_element_type=jnp.float32)  # noqa: E731
    dx, = jax.linear_transpose(lambda a: dot(sizes)(a, w), x)(ct)
    dw, = jax.linear_transpose(lambda b: dot(padded)(x, b),
                               jax.ShapeDtypeStruct((padded.shape[0],) + w.shape[1:], w.dtype))(ct)
    return dx, dw[:G], None


ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


class Gate(nnx.Module):
    """Scores in fp32; the bias picks experts but the weights come from the unbiased scores."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg_topk, self.score_func = cfg.n_activated_experts, cfg.score_func
        self.gate_temp, self.norm_topk_prob, self.route_scale = cfg.gate_temp, cfg.norm_topk_prob, cfg.route_scale
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (cfg.n_routed_experts, cfg.dim)) * 2 / math.sqrt(cfg.dim)).astype(jnp.bfloat16))
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (cfg.n_routed_experts,), jnp.float32) * 0.1)
        # image-span tokens select with their own bias (docs/VISION.md); only VL checkpoints carry it
        self.bias_vl = (nnx.Param(jax.random.normal(rngs.params(), (cfg.n_routed_experts,), jnp.float32) * 0.1)
                        if cfg.vision_enabled else None)

    def selection_bias(self, vl_mask=None):
        """The bias added to the scores for selection: `bias_vl` where vl_mask [...] holds, else `bias`."""
        if vl_mask is None or self.bias_vl is None:
            return self.bias[...]
        return jnp.where(vl_mask[..., None], self.bias_vl[...], self.bias[...])

    def scores(self, x, mode):
        s = matmul(x.astype(jnp.float32), self.weight[...].astype(jnp.float32), "...d,ed->...e", jnp.float32, mode)
        s = s / jnp.float32(self.gate_temp)
        if self.score_func == "softmax":
            return jax.nn.softmax(s, axis=-1)
        # torch's sigmoid and softplus run their scalar lambdas (glibc expf, log1pf) on the call's last
        # elements (docs/NUMERICS.md); the last two dims are one call ([T, E] per sequence)
        if self.score_func == "sigmoid":
            return sigmoid(s, mode, tail_dims=min(2, s.ndim))
        return sqrt(softplus(s, mode, tail_dims=min(2, s.ndim)), mode)

    def select(self, scores, vl_mask=None):
        """(biased scores, experts [..., k]): the selection, experts ordered by descending biased score.

        vl_mask: optional bool [...], True for image-span tokens (they select with `bias_vl`)."""
        biased = scores + self.selection_bias(vl_mask)
        return biased, jax.lax.top_k(biased, self.cfg_topk)[1]

    def weights(self, scores, experts, mode: str = "fast"):
        """The chosen experts' weights [..., k], from the unbiased scores (normalised, then scaled)."""
        w = jnp.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob and self.cfg_topk > 1:
            total = torch_sum_last(w, keepdims=True) if mode == "exact" else jnp.sum(w, axis=-1, keepdims=True)
            w = true_divide(w, total + jnp.float32(1e-20))
        return w * jnp.float32(self.route_scale)


class Experts(nnx.Module):
    """The routed experts, stacked. kind fp4 (MXFP4 packed), fp8 or dense."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.kind = weight_kind(cfg, expert=True)
        self.limit = cfg.swiglu_limit
        E, d, f = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim

        def make(out, inp, std):
            w = jax.random.normal(rngs.params(), (E, out, inp), jnp.float32) * std
            if self.kind == "fp4":
                q, s = jax.vmap(quant.quant_fp4_weight)(w)
                return nnx.Param(q), nnx.Param(s)
            if self.kind == "fp8":
                q, s = jax.vmap(quant.quant_fp8_weight)(w)
                return nnx.Param(q), nnx.Param(s)
            return nnx.Param(w.astype(jnp.bfloat16)), None

        self.w1, self.w1_scale = make(f, d, 1 / math.sqrt(d))
        self.w2, self.w2_scale = make(d, f, 0.2 / math.sqrt(f))
        self.w3, self.w3_scale = make(f, d, 1 / math.sqrt(d))

    def _lin(self, x, w, s, mode):
        return gemm.linear(x, w, s, kind=self.kind, mode=mode)

    def per_row(self, x, experts, weights, mode):
        """Expert outputs for rows (token, slot): x [n, d], experts [n], weights [n] -> [n, d] bf16.

        Gathers each row's expert weights: cost and bytes grow with the active experts only,
        which suits decode; prefill-sized batches go through `grouped`.
        """
        @gemm.fp8_kernel(None)  # a row's gathered expert (never the whole stack) through the XLA math: no kernel under vmap
        def one(xr, e, wr):
            g = lambda a: None if a is None else a[...][e]
            h = swiglu(self._lin(xr[None], g(self.w1), g(self.w1_scale), mode),
                       self._lin(xr[None], g(self.w3), g(self.w3_scale), mode), self.limit, mode)
            h = no_fma(wr * h).astype(xr.dtype)
            return self._lin(h, g(self.w2), g(self.w2_scale), mode)[0]

        return jax.vmap(one)(x, experts, weights)

    def per_expert(self, x, experts, weights, mode, chunk: int = 64):
        """`per_row`'s outputs, bit for bit, with each expert's rows run together: x [n, d] rows,
        experts [n], weights [n] -> [n, d] bf16.

        `per_row` gathers every row's expert weights (at the released width, 520 tokens x 6 rows of
        dequantized 2304 x 5120 matrices: hundreds of GB in exact mode). Here the rows are sorted by
        expert and each expert runs its rows in chunks of `chunk` (a loop of dynamic length: an
        expert no row routes to costs nothing), reading its weights once a chunk. Every row of a
        GEMM depends on that row only, so a row's output equals its own one-row GEMM."""
        n, d = x.shape
        order = jnp.argsort(experts, stable=True)
        counts = jnp.bincount(experts, length=self.w1.shape[0])
        starts = jnp.cumsum(counts) - counts
        pad = lambda a: jnp.concatenate([a, jnp.zeros((chunk,) + a.shape[1:], a.dtype)])  # slices stay in range
        xs, ws, dest = pad(x[order]), pad(weights[order]), pad(order)

        def one_expert(e, out):
            g = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a[...], e, keepdims=False)

            def one_chunk(i, out):
                s = starts[e] + i * chunk
                xr = jax.lax.dynamic_slice_in_dim(xs, s, chunk)
                wr = jax.lax.dynamic_slice_in_dim(ws, s, chunk)
                h = swiglu(self._lin(xr, g(self.w1), g(self.w1_scale), mode),
                           self._lin(xr, g(self.w3), g(self.w3_scale), mode), self.limit, mode)
                h = no_fma(wr[:, None] * h).astype(x.dtype)
                y = self._lin(h, g(self.w2), g(self.w2_scale), mode)
                rows = s + jnp.arange(chunk)
                # rows past this expert's own (the next expert's, or padding) are dropped
                to = jnp.where(rows < starts[e] + counts[e], jax.lax.dynamic_slice_in_dim(dest, s, chunk), n)
                return out.at[to].set(y, mode="drop")

            return jax.lax.fori_loop(0, -(-counts[e] // chunk), one_chunk, out)

        return jax.lax.fori_loop(0, self.w1.shape[0], one_expert, jnp.zeros((n, d), x.dtype))

    def dense_weights(self, which=None):
        """(w1, w2, w3) as bf16 [E', out, in]: the experts `which` [E'] (default all), gathered in
        their stored format before they are dequantized, so that only those are dequantized."""
        deq = {"fp4": quant.dequant_fp4_weight, "fp8": quant.dequant_fp8_weight}.get(self.kind)
        take = (lambda a: a[...]) if which is None else (lambda a: a[...][which])
        if deq is None:
            return take(self.w1), take(self.w2), take(self.w3)
        return tuple(jax.vmap(deq)(take(w), take(s)).astype(jnp.bfloat16)
                     for w, s in ((self.w1, self.w1_scale), (self.w2, self.w2_scale), (self.w3, self.w3_scale)))

    def grouped(self, x, experts, weights, mode):
        """Sort rows by expert and run ragged GEMMs over the active experts' dequantized weights
        (XLA fallback for prefill-sized batches).

        Only the distinct experts of the rows are gathered and dequantized: at most min(E, n), a
        static bound; the padding slots repeat the smallest active expert with no rows, so no
        inactive expert is ever dequantized. When n >= E (the released 384 experts x 6 at batch 64)
        the bound is every expert: a static shape cannot shrink further, only the expert kernel
        (impl "pallas") dequantizes inside each group's tiles."""
        E, n = self.w1.shape[0], x.shape[0]
        order = jnp.argsort(experts, stable=True)
        xs, es, ws = x[order], experts[order], weights[order]
        U = min(E, n)
        active = jnp.unique(es, size=U, fill_value=es[0])  # ascending, padded at the end
        n_active = 1 + jnp.sum(es[1:] != es[:-1])
        sizes = jnp.where(jnp.arange(U) < n_active, jnp.bincount(es, length=E)[active], 0).astype(jnp.int32)
        w1, w2, w3 = self.dense_weights(active)
        quantize = self.kind != "dense"
        xq = quant.fake_fp8_act(xs, 32) if quantize else xs
        up1 = ragged_dot(xq, jnp.swapaxes(w1, 1, 2), sizes).astype(x.dtype)
        up3 = ragged_dot(xq, jnp.swapaxes(w3, 1, 2), sizes).astype(x.dtype)
        h = (ws[:, None] * swiglu(up1, up3, self.limit)).astype(x.dtype)
        hq = quant.fake_fp8_act(h, 32) if quantize else h
        out = ragged_dot(hq, jnp.swapaxes(w2, 1, 2), sizes).astype(x.dtype)
        return jnp.zeros_like(out).at[order].set(out)


class SharedExpert(nnx.Module):
    """The always-on expert (FP8 linears on the checkpoint)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        kind, d, f = weight_kind(cfg), cfg.dim, cfg.moe_inter_dim
        self.limit = cfg.swiglu_limit
        self.w1 = QLinear(d, f, kind, rngs=rngs, std=1.5 / math.sqrt(d))
        self.w2 = QLinear(f, d, kind, rngs=rngs, std=0.2 / math.sqrt(f))
        self.w3 = QLinear(d, f, kind, rngs=rngs, std=1.5 / math.sqrt(d))

    def __call__(self, x, mode):
        h = swiglu(self.w1(x, mode), self.w3(x, mode), self.limit, mode).astype(x.dtype)
        return self.w2(h, mode)


class MoE(nnx.Module):
    """Gate + routed experts + shared expert, in two steps: `route` (the gate's choice) and `apply`
    (the chosen experts and the shared one); the layer body's probe decides between them."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.gate = Gate(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.shared_experts = SharedExpert(cfg, rngs=rngs)
        self.topk = cfg.n_activated_experts
        self.grouped_threshold = GROUPED_ROWS
        self.per_row_tokens = PER_ROW_TOKENS

    def route(self, x, mode, vl_mask=None):
        """x [B, T, d] -> (scores [B,T,E] fp32, biased [B,T,E], experts [B,T,k]): the gate's own choice.

        The layer body hands (experts, biased) to its probe's `decide("experts", ...)`, which may
        replace them (golden-check's forced runs), then calls `apply` with the experts to run.
        vl_mask: optional bool [B, T], True at image-span positions (routed with `gate.bias_vl`)."""
        B, T, d = x.shape
        # one oracle call per sequence: [T, E] (for B = 1 the reference's flattened [B*T, E] is the same tensor)
        scores = self.gate.scores(x, mode).reshape(B * T, -1)
        biased, experts = self.gate.select(scores, None if vl_mask is None else vl_mask.reshape(B * T))
        E = scores.shape[-1]
        return scores.reshape(B, T, E), biased.reshape(B, T, E), experts.reshape(B, T, -1)

    def slots(self, scores, experts, mode):
        """Flat per-token slots in the order the reference sums them: (weights [N,k], experts [N,k]
        in ascending expert order, their weights [N,k]) for scores [B,T,E] and experts [B,T,k]."""
        E, k = scores.shape[-1], experts.shape[-1]
        weights = self.gate.weights(scores.reshape(-1, E), experts.reshape(-1, k), mode)
        # the reference adds expert outputs in ascending expert order in fp32; sort slots to match
        slot_order = jnp.argsort(experts.reshape(-1, k), axis=-1)
        return (weights, jnp.take_along_axis(experts.reshape(-1, k), slot_order, -1),
                jnp.take_along_axis(weights, slot_order, -1))

    def combine(self, x, out, scores, experts, weights, mode):
        """The routed outputs out [N, k, d] summed in slot order in fp32, plus the shared expert:
        (y [B,T,d] in x.dtype, info = {scores, experts, weights})."""
        B, T, d = x.shape
        k = out.shape[1]
        flat = x.reshape(B * T, d)
        out = out.astype(jnp.float32)
        y = jnp.zeros((B * T, d), jnp.float32)
        for j in range(k):
            y = y + out[:, j]
        y = y + self.shared_experts(flat, mode).astype(jnp.float32)
        info = {"scores": scores, "experts": experts, "weights": weights.reshape(B, T, k)}
        return y.astype(x.dtype).reshape(B, T, d), info

    def apply(self, x, scores, experts, mode, impl="xla", interpret=False):
        """The chosen experts [B,T,k] on x [B,T,d] bf16, weighted from `scores` (route's), plus the
        shared expert: (y bf16, info = {scores, experts, weights}).

        impl, interpret: resolved (`dsv41_jax.model.block.Plan.resolve`, never "auto" or None here);
        impl "pallas" runs the grouped FP4 expert kernel in fast mode. Exact mode always runs the
        per-row math (`per_row`, or the same bits from `per_expert` for prefills over
        `per_row_tokens` tokens): the kernel has no exact mode (it would not match the oracle's rounding)."""
        B, T, d = x.shape
        k = experts.shape[-1]
        weights, e_sorted, w_sorted = self.slots(scores, experts, mode)
        rows = jnp.repeat(x.reshape(B * T, d), k, axis=0)
        n = B * T * k
        if mode != "exact" and impl == "pallas" and self.experts.kind == "fp4":
            from pallas_kernels import expert_gemm_moe  # noqa: WPS433 (optional dependency on the kernels)
            out = expert_gemm_moe(self.experts, rows, e_sorted.reshape(-1), w_sorted.reshape(-1), interpret=interpret)
        elif mode == "exact" and B * T > self.per_row_tokens:
            out = self.experts.per_expert(rows, e_sorted.reshape(-1), w_sorted.reshape(-1), mode)
        elif mode == "exact" or n <= self.grouped_threshold:
            out = self.experts.per_row(rows, e_sorted.reshape(-1), w_sorted.reshape(-1), mode)
        else:
            out = self.experts.grouped(rows, e_sorted.reshape(-1), w_sorted.reshape(-1), mode)
        return self.combine(x, out.reshape(B * T, k, d), scores, experts, weights, mode)

    def __call__(self, x, mode, impl="xla", interpret=False, vl_mask=None):
        """`apply` on the gate's own choice (no probe): (y, info)."""
        scores, _, experts = self.route(x, mode, vl_mask)
        return self.apply(x, scores, experts, mode, impl, interpret)

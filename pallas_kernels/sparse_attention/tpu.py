"""Sparse sink attention on TPU (Mosaic): per-slot DMA gathers of FP8 window and FP4 compressed rows.

One grid step per query row (b, s): decode is the S = 1 case (grid over the batch, the 64 heads
of a row share one gathered KV set and form the matmuls' M dimension); prefill/training is the
same kernel over B*S rows. The index lists of the current and of the next row arrive as small
SMEM blocks; while row r is computed, the rows of r+1 are DMA-gathered (one DMA per valid slot and
array, skipped for -1 slots) into the other half of a double buffer. Dequantisation happens in
VMEM with 32-bit integer ops (common/bits.py); the scale bytes are spread over their lanes with
tiny one-hot matmuls (common/lanes.py). The head dimension is processed in the 8-plane order of
the word view (planes.py). The softmax is exact over all slots of a row (no online blocks):

    o_h = sum_j bf16(e^{s_j - m}) v_j / (sum_j e^{s_j - m} + e^{sink_h - m}),  m = max_j s_j,

P rounded to bf16 for P.V only (golden README, oracle choice 1); rows without a valid slot give 0.
Grid steps are sequential ("arbitrary") because each step prefetches for the next.

exact=True (interpret mode only, float64 enabled) keeps the gathers and the decode but computes
the math of `dsv41_jax.numerics.sparse_attention.sparse_attention(mode="exact")` (the golden oracle's sparse_attn): the
slots of a row in order (window, then compressed) in 64-wide online-softmax blocks, float64
dots rounded once to f32, MKL exp (`mkl_exp`), P rounded to bf16 for P.V only, no FMA contraction, a true
division at the end. Mosaic has no float64, so this variant cannot be compiled for a TPU.
Untested on TPU hardware: the CPU tests run it in interpret mode and lower it for TPU with
jax.export (Mosaic lowering rules only; Mosaic's layout passes run when a TPU compiles it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsv41_jax.numerics import kv_layout
from dsv41_jax.numerics.exact_ops import no_fma, true_divide
from dsv41_jax.numerics.mkl_exp import expf_mkl
from pallas_kernels.common import bits
from pallas_kernels.common import lanes as lanes_mod
from pallas_kernels.sparse_attention.planes import from_planes, to_planes

_NEG_INF = float("-inf")


def _window_planes(low: jax.Array, high: jax.Array, scale_words: jax.Array) -> list[jax.Array]:
    """Gathered window words -> 8 bf16 planes [K, D/8] (E4M3 x E8M0 per 32, exact in bf16)."""
    lanes = low.shape[-1]
    scale = bits.e8m0_to_f32(lanes_mod.scale_byte_per_lane(scale_words, lanes, 32))
    planes = []
    for n in range(8):
        code = bits.byte_of_word(low if n < 4 else high, n % 4)
        planes.append((bits.e4m3_to_f32(code) * scale).astype(jnp.bfloat16))
    return planes


def _compressed_planes(packed: jax.Array, scale_words: jax.Array) -> list[jax.Array]:
    """Gathered compressed words -> 8 bf16 planes [K, D/8] (E2M1 x E4M3 per 16, exact in bf16)."""
    lanes = packed.shape[-1]
    scale = bits.e4m3_to_f32(lanes_mod.scale_byte_per_lane(scale_words, lanes, 16))
    return [(bits.e2m1_to_f32(bits.nibble_of_word(packed, n)) * scale).astype(jnp.bfloat16) for n in range(8)]


def _scores(q_planes, k_planes, scale: float) -> jax.Array:
    """sum over planes of q_n . k_n^T -> f32 [H, K]."""
    acc = None
    for qn, kn in zip(q_planes, k_planes):
        part = jax.lax.dot_general(qn, kn, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    return acc * jnp.float32(scale)


EXACT_BLOCK = 64  # online-softmax block of the oracle's sparse_attn (golden README, oracle choice 1)


def _attend_exact(q_planes, parts, sink, scale):
    """The oracle's blocked online softmax over the slots of one row, in float64/f32 as
    `numerics.sparse_attention._exact`. parts: [(valid [1, K], 8 bf16 planes [K, D/8])] in slot
    order. Returns 8 f32 output planes [H, D/8]."""
    f32, f64 = jnp.float32, jnp.float64
    valid = jnp.concatenate([v for v, _ in parts], axis=1) if len(parts) > 1 else parts[0][0]
    planes = [jnp.concatenate([pl_[n] for _, pl_ in parts], axis=0) if len(parts) > 1 else parts[0][1][n]
              for n in range(8)]
    n_slots = valid.shape[1]
    heads = q_planes[0].shape[0]
    q64 = [qn.astype(f64) for qn in q_planes]
    m = jnp.full((heads, 1), _NEG_INF, f32)
    l = jnp.zeros((heads, 1), f32)
    acc = [jnp.zeros((heads, qn.shape[1]), f32) for qn in q_planes]
    for lo in range(0, n_slots, EXACT_BLOCK):
        hi = min(lo + EXACT_BLOCK, n_slots)
        k64 = [planes[n][lo:hi].astype(f64) for n in range(8)]
        dots = None
        for n in range(8):
            part = jax.lax.dot_general(q64[n], k64[n], (((1,), (1,)), ((), ())), preferred_element_type=f64)
            dots = part if dots is None else dots + part
        mask = valid[:, lo:hi]
        s = no_fma(dots.astype(f32) * f32(scale))
        s = jnp.where(mask, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(jnp.isfinite(m_new), m_new, f32(0.0))
        alpha = expf_mkl(m - m_use)
        p = jnp.where(mask, expf_mkl(s - m_use), f32(0.0))
        p_sum = jnp.sum(p.astype(f64), axis=1, keepdims=True).astype(f32)
        p64 = p.astype(jnp.bfloat16).astype(f64)
        l = no_fma(l * alpha) + p_sum
        for n in range(8):
            pv = jnp.dot(p64, k64[n], preferred_element_type=f64).astype(f32)
            acc[n] = no_fma(acc[n] * alpha) + pv
        m = m_new
    any_valid = jnp.isfinite(m)
    m_use = jnp.where(any_valid, m, f32(0.0))
    denom = l + expf_mkl(sink - m_use)
    return [jnp.where(any_valid, true_divide(a, denom), f32(0.0)) for a in acc]


def _kernel(*refs, rows_per_batch, n_rows, n_win_rows, n_comp_rows, k_win, k_comp, scale, exact=False, layered=False):
    """One query row: wait for its gathered rows, prefetch the next row's, attend.

    Longer than 80 lines on purpose: the DMA waits, the prefetch of the next row and the attention
    share the semaphores and scratch buffers of one grid step, and split into functions they would
    need those refs threaded through every call, which hides the double-buffering order.
    """
    has_win, has_comp = k_win > 0, k_comp > 0
    it = iter(refs)
    layer_ref = next(it) if layered else None  # the window's layer, when it holds stacked rings
    win_cur = next(it) if has_win else None
    win_next = next(it) if has_win else None
    comp_cur = next(it) if has_comp else None
    comp_next = next(it) if has_comp else None
    win_mask = next(it) if has_win else None
    comp_mask = next(it) if has_comp else None
    q_ref, sink_ref = next(it), next(it)
    win_hbm = (next(it), next(it), next(it)) if has_win else ()
    comp_hbm = (next(it), next(it)) if has_comp else ()
    o_ref = next(it)
    win_buf = (next(it), next(it), next(it)) if has_win else ()
    comp_buf = (next(it), next(it)) if has_comp else ()
    sems = next(it)

    r = pl.program_id(0)
    slot = bits.irem(r, 2)

    def copies(idx_ref, hbm, bufs, sem0, n_src, batch, buf_slot, j):
        """The DMAs of slot j: one per cache array (values, scales), same shapes for start and wait."""
        row = jnp.minimum(idx_ref[0, 0, j], n_src - 1)
        at = lambda src: src.at[layer_ref[0], batch] if layered and sem0 == 0 else src.at[batch]  # noqa: E731
        return [
            pltpu.make_async_copy(at(src).at[pl.ds(row, 1)], buf.at[buf_slot, pl.ds(j, 1)], sems.at[sem0 + a, buf_slot])
            for a, (src, buf) in enumerate(zip(hbm, bufs))
        ]

    def for_valid_slots(idx_ref, k, hbm, bufs, sem0, n_src, batch, buf_slot, action):
        def body(j, carry):
            @pl.when(idx_ref[0, 0, j] >= 0)
            def _():
                for c in copies(idx_ref, hbm, bufs, sem0, n_src, batch, buf_slot, j):
                    getattr(c, action)()

            return carry

        jax.lax.fori_loop(0, k, body, 0)

    def gather(win_idx, comp_idx, batch, buf_slot, action):
        if has_win:
            for_valid_slots(win_idx, k_win, win_hbm, win_buf, 0, n_win_rows, batch, buf_slot, action)
        if has_comp:
            for_valid_slots(comp_idx, k_comp, comp_hbm, comp_buf, 3, n_comp_rows, batch, buf_slot, action)

    @pl.when(r == 0)
    def _first_row():
        # never-written buffer rows must decode to finite values: a -1 slot keeps stale data
        for buf in win_buf + comp_buf:
            buf[...] = jnp.zeros(buf.shape, buf.dtype)
        gather(win_cur, comp_cur, 0, 0, "start")

    gather(win_cur, comp_cur, bits.idiv(r, rows_per_batch), slot, "wait")

    @pl.when(r + 1 < n_rows)
    def _prefetch_next_row():
        gather(win_next, comp_next, bits.idiv(r + 1, rows_per_batch), 1 - slot, "start")

    q = q_ref[0]
    q_planes = [q[n] for n in range(8)]
    sink = sink_ref[...]  # [H, 1]
    if exact:
        parts = []
        if has_win:
            parts.append((win_mask[0] >= 0, _window_planes(win_buf[0][slot], win_buf[1][slot], win_buf[2][slot])))
        if has_comp:
            parts.append((comp_mask[0] >= 0, _compressed_planes(comp_buf[0][slot], comp_buf[1][slot])))
        for n, out in enumerate(_attend_exact(q_planes, parts, sink, scale)):
            o_ref[0, n] = out.astype(o_ref.dtype)
        return
    parts = []  # (scores [H, K], valid [1, K], value planes)
    if has_win:
        planes = _window_planes(win_buf[0][slot], win_buf[1][slot], win_buf[2][slot])
        parts.append((_scores(q_planes, planes, scale), win_mask[0] >= 0, planes))
    if has_comp:
        planes = _compressed_planes(comp_buf[0][slot], comp_buf[1][slot])
        parts.append((_scores(q_planes, planes, scale), comp_mask[0] >= 0, planes))

    m = None
    for s, valid, _ in parts:
        row_max = jnp.max(jnp.where(valid, s, _NEG_INF), axis=1, keepdims=True)
        m = row_max if m is None else jnp.maximum(m, row_max)
    any_valid = m > _NEG_INF
    m_safe = jnp.where(any_valid, m, 0.0)
    denom = jnp.exp(sink - m_safe)
    acc = [None] * 8
    for s, valid, planes in parts:
        p = jnp.where(valid, jnp.exp(s - m_safe), 0.0)
        denom = denom + jnp.sum(p, axis=1, keepdims=True)
        p16 = p.astype(jnp.bfloat16)
        for n in range(8):
            pv = jnp.dot(p16, planes[n], preferred_element_type=jnp.float32)
            acc[n] = pv if acc[n] is None else acc[n] + pv
    for n in range(8):
        out = jnp.where(any_valid, acc[n] / denom, 0.0)
        o_ref[0, n] = out.astype(o_ref.dtype)


def sparse_sink_attention_tpu(
    q: jax.Array,
    window: kv_layout.WindowKV,
    compressed: kv_layout.CompressedKV | None,
    window_idx: jax.Array,
    compressed_idx: jax.Array | None,
    sink: jax.Array,
    scale: float,
    *,
    interpret: bool = False,
    exact: bool = False,
    window_layer: jax.Array | None = None,
) -> jax.Array:
    """Mosaic TPU kernel; shapes and semantics as `pallas_kernels.sparse_sink_attention`.

    exact: the oracle's numerics in float64 (see the module docstring); needs interpret=True and
    `jax.enable_x64(True)`. window_layer: int32 [1]: the window holds rings stacked on a leading
    layer axis ([L, B, Nw, ...]) and the kernel gathers from this layer's, in place.

    Longer than 80 lines on purpose: the refusals, the grid, the block specs and the scratch
    shapes of one pallas_call read the same derived sizes, and kept together each spec can be
    checked against the kernel's ref order in one place.
    """
    if exact and not interpret:
        raise ValueError("sparse_sink_attention_tpu(exact=True) computes in float64, which Mosaic cannot "
                         "compile: run it with interpret=True (or use the fast kernel)")
    if exact and jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64:
        raise RuntimeError("sparse_sink_attention_tpu(exact=True) needs float64: wrap the call in "
                           "`with jax.enable_x64(True):`")
    B, S, H, D = q.shape
    R = B * S
    D8 = D // 8
    layered = window_layer is not None
    k_win = int(window_idx.shape[-1]) if window is not None and window[0].shape[1 + layered] > 0 else 0
    k_comp = (
        int(compressed_idx.shape[-1])
        if compressed is not None and compressed_idx is not None and compressed.packed.shape[1] > 0
        else 0
    )
    if k_win == 0 and k_comp == 0:
        return jnp.zeros_like(q)

    smem_row = lambda k, nxt: pl.BlockSpec(  # noqa: E731
        (1, 1, k),
        (lambda r: (jnp.minimum(r + 1, R - 1), 0, 0)) if nxt else (lambda r: (r, 0, 0)),
        memory_space=pltpu.SMEM,
    )
    vmem_row3 = lambda k: pl.BlockSpec((1, 1, k), lambda r: (r, 0, 0))  # noqa: E731
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    args, in_specs, scratch = [], [], []
    layered = layered and k_win > 0
    if layered:
        args.append(window_layer.reshape(1).astype(jnp.int32))
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    if k_win:
        widx = window_idx.reshape(R, 1, k_win).astype(jnp.int32)
        args += [widx, widx]
        in_specs += [smem_row(k_win, False), smem_row(k_win, True)]
    if k_comp:
        cidx = compressed_idx.reshape(R, 1, k_comp).astype(jnp.int32)
        args += [cidx, cidx]
        in_specs += [smem_row(k_comp, False), smem_row(k_comp, True)]
    if k_win:
        args.append(widx)
        in_specs.append(vmem_row3(k_win))
    if k_comp:
        args.append(cidx)
        in_specs.append(vmem_row3(k_comp))
    args += [to_planes(q).reshape(R, 8, H, D8), sink.astype(jnp.float32).reshape(H, 1)]
    in_specs += [pl.BlockSpec((1, 8, H, D8), lambda r: (r, 0, 0, 0)), pl.BlockSpec((H, 1), lambda r: (0, 0))]
    as_i32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    n_win_rows = n_comp_rows = 0
    if k_win:
        words = kv_layout.window_words(window)
        n_win_rows = int(words.low.shape[1 + layered])
        for a in words:
            args.append(as_i32(a))
            in_specs.append(hbm)
            scratch.append(pltpu.VMEM((2, k_win, a.shape[-1]), jnp.int32))
    if k_comp:
        words = kv_layout.compressed_words(compressed)
        n_comp_rows = int(words.packed.shape[1])
        for a in words:
            args.append(as_i32(a))
            in_specs.append(hbm)
            scratch.append(pltpu.VMEM((2, k_comp, a.shape[-1]), jnp.int32))
    scratch.append(pltpu.SemaphoreType.DMA((5, 2)))

    kernel = functools.partial(
        _kernel,
        rows_per_batch=S,
        n_rows=R,
        n_win_rows=n_win_rows,
        n_comp_rows=n_comp_rows,
        k_win=k_win,
        k_comp=k_comp,
        scale=float(scale),
        exact=bool(exact),
        layered=layered,
    )
    # per query row: H heads score and weigh every gathered key (k_win + k_comp) over D dims, one exp
    # per score (and the sink); it gathers its rows of the window (FP8 + scales) and compressed cache
    # (FP4 + scales), reads its query and indices, writes its output
    keys = k_win + k_comp
    cost = pl.CostEstimate(
        flops=4 * R * H * keys * D, transcendentals=R * H * (keys + 1),
        bytes_accessed=R * (k_win * (D + D // 32) + k_comp * (D // 2 + D // 16) + 2 * H * D * 2 + 3 * keys * 4))
    out = pl.pallas_call(
        kernel,
        grid=(R,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, 8, H, D8), lambda r: (r, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((R, 8, H, D8), q.dtype),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        cost_estimate=cost,
        name="sparse_sink_attention_tpu",
    )(*args)
    return from_planes(out.reshape(B, S, 8, H, D8))

"""How a traced step reads its stored FP8/FP4 weights: the bytes of each weight it reads, and what it
materializes from whole weights outside a kernel (the aim: stored weights read once, in their stored
format). Platform-independent: it follows each weight through the step's jaxpr, so it also covers
the kernel path, whose kernels XLA's cost analysis cannot see into (a custom call on TPU/GPU, an
interpreted loop on CPU), and it is not misled by the CPU lowering of `ragged_dot`.

Each weight parameter is followed through the ops that keep it whole (converts, reshapes, static
slices, bit packing, scaling) up to the dot that consumes it. Its uses are:
- "gathered": rows picked out of it by data (one row's expert, the active experts): the rows'
  bytes are read, and their dequantized values (bf16) written and read back;
- "kernel": it enters a Pallas kernel (directly, as stored or as the word view made once at load,
  or after a relayout into 32-bit words outside the kernel, which writes and reads the weight's
  bytes once more on every call): the kernel reads it;
- "dequantized": a floating-point value the size of the weight is made from it outside a kernel:
  the stored bytes are read and the dequantized weight (at least bf16, 2 bytes per value) is
  written and read back by the dot.
`traffic` turns the uses into bytes per step; the routed experts through the grouped expert kernel
count min(E, rows)/E of the stack (the kernel reads only non-empty experts' tiles).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_GATHERS = {"gather", "dynamic_slice"}  # rows picked by data (routing, a row's expert)
_CONSUMERS = {"dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated"}
_KERNELS = {"pallas_call"}
# rows written into an array (a cache's new rows): the array itself as updated in place, no copy
_UPDATES = {"scatter", "dynamic_update_slice"}
_SAME = {"stop_gradient"}  # the operand itself (no copy): e.g. the indexer's query weights, which take no gradient
# (and same-width bitcasts, `_same_bytes`)


@dataclasses.dataclass
class WeightUse:
    name: str
    shape: tuple
    stored_bytes: int
    elements: int  # stored elements
    packed: bool = False  # packed FP4: two values a byte
    gathered_bytes: int = 0
    kernels: set = dataclasses.field(default_factory=set)
    relayout_bytes: int = 0  # whole-weight non-float copies made outside the kernel it enters
    gathered_values: int = 0  # values dequantized from gathered rows (each gather's rows once)
    dequantized: list = dataclasses.field(default_factory=list)  # (shape, primitive) of whole-weight floats


def stored_weights(params) -> dict[int, WeightUse]:
    """{leaf index: WeightUse} of the stored quantized weights among params' leaves (FP8 matrices,
    packed FP4 expert stacks, or their kernels' int32 word views made at load by
    `dsv41_jax.model.kernel_weights.kernel_params`: the same bytes; E8M0 scales and lookup tables' scales
    excluded). `elements` counts stored bytes (one FP8 value, or two FP4 values, a byte)."""
    out = {}
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        name = jax.tree_util.keystr(path)
        nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        fp8 = leaf.dtype == jnp.float8_e4m3fn and leaf.ndim >= 2
        fp4 = leaf.dtype == jnp.uint8 and leaf.ndim == 3 and "scale" not in name
        words = leaf.dtype == jnp.int32 and leaf.ndim == 3 and "scale" not in name
        if fp8 or fp4 or words:
            out[i] = WeightUse(name, tuple(leaf.shape), nbytes, nbytes, fp4 or (words and "['experts']" in name))
    return out


def kernel_name(eqn) -> str:
    """The name a `pallas_call` equation's kernel was given."""
    info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
    return str(getattr(info, "name", info)).split(" ")[0]


def sub_jaxprs(eqn):
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(j, jax.extend.core.ClosedJaxpr):
                yield j.jaxpr
            elif isinstance(j, jax.extend.core.Jaxpr):
                yield j


def follow(jaxpr, tainted: dict) -> None:
    """tainted: {var: Taint}; records uses into the WeightUses."""
    is_var = lambda v: isinstance(v, jax.extend.core.Var)
    for eqn in jaxpr.eqns:
        hits = [(v, tainted[v]) for v in eqn.invars if is_var(v) and v in tainted]
        if not hits:
            continue
        prim = eqn.primitive.name
        if prim in _KERNELS:
            for v, t in dict(hits).items():  # an operand passed twice (the FP8 view's two planes) is one copy
                if t.rows:
                    continue  # gathered rows (counted) as a kernel's input, e.g. Engram rows into a GEMM
                t.use.kernels.add(kernel_name(eqn))
                if not t.itself and not t.rows:
                    t.use.relayout_bytes += int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
            continue
        if prim in _GATHERS and eqn.invars[0] in tainted and all(
                v not in tainted for v in eqn.invars[1:] if is_var(v)):
            t = tainted[eqn.invars[0]]
            if not t.rows:
                t.use.gathered_bytes += sum(int(np.prod(o.aval.shape)) * o.aval.dtype.itemsize for o in eqn.outvars)
            for o in eqn.outvars:  # rows picked by data: followed on to their dequantization
                tainted[o] = Taint(t.use, False, int(np.prod(o.aval.shape)), True, t.counted)
            continue
        if prim in _CONSUMERS:
            continue  # the dot that uses the (dequantized) weight
        if prim in _UPDATES and eqn.invars[0] in tainted and all(
                v not in tainted for v in eqn.invars[1:] if is_var(v)):
            tainted[eqn.outvars[0]] = tainted[eqn.invars[0]]  # rows written into the array itself (a cache)
            continue
        if prim in _SAME or _same_bytes(eqn):
            for v, o in zip(eqn.invars, eqn.outvars):
                if is_var(v) and v in tainted:
                    tainted[o] = tainted[v]
            continue
        subs = list(sub_jaxprs(eqn))
        if subs:  # call-like primitives pass their operands in order (pjit, custom_jvp/vjp, remat)
            for sub in subs:
                n = min(len(sub.invars), len(eqn.invars))
                inner = {sub.invars[i]: tainted[eqn.invars[i]] for i in range(n)
                         if is_var(eqn.invars[i]) and eqn.invars[i] in tainted}
                follow(sub, inner)
                for i, o in enumerate(sub.outvars):
                    if is_var(o) and o in inner and i < len(eqn.outvars):
                        tainted[eqn.outvars[i]] = inner[o]._replace(itself=False)
            continue
        t = hits[0][1]
        for o in eqn.outvars:  # elementwise, reshapes, static slices, bit packing: still the weight
            if not hasattr(o.aval, "shape"):
                continue
            size = int(np.prod(o.aval.shape))
            dequant = (jnp.issubdtype(o.aval.dtype, jnp.floating) and o.aval.dtype != jnp.float8_e4m3fn
                       and size >= t.size)
            if dequant and t.rows and not t.counted:
                t.use.gathered_values += size
            elif dequant and not t.rows:
                t.use.dequantized.append((tuple(o.aval.shape), prim))
            tainted[o] = t._replace(itself=False, counted=t.counted or dequant)


def _same_bytes(eqn) -> bool:
    """A bitcast between types of one width (uint32 -> int32, float8 -> uint8): the operand's own
    bytes in their own layout, no copy."""
    if eqn.primitive.name != "bitcast_convert_type":
        return False
    i, o = eqn.invars[0].aval, eqn.outvars[0].aval
    return i.shape == o.shape and i.dtype.itemsize == o.dtype.itemsize


class Taint(NamedTuple):
    use: WeightUse
    itself: bool  # the parameter as stored
    size: int  # elements of the whole weight, or of the gathered rows
    rows: bool = False  # gathered rows, not the whole weight
    counted: bool = False  # the gathered rows' dequantization is counted already


def trace_uses(fn, params, *args) -> list[WeightUse]:
    """The stored weights' uses in fn(params_leaves, *args)'s trace (fn takes the flat leaves)."""
    return uses_in(jax.make_jaxpr(fn)(jax.tree_util.tree_leaves(params), *args), params)


def uses_in(closed, params) -> list[WeightUse]:
    """The stored weights' uses in a traced program whose first inputs are params' leaves (a jitted
    step's `.trace(params, ...).jaxpr`, or `trace_uses`' jaxpr)."""
    weights = stored_weights(params)
    follow(closed.jaxpr, {closed.jaxpr.invars[i]: Taint(w, True, w.elements) for i, w in weights.items()})
    return list(weights.values())


def traffic(uses: list[WeightUse], *, rows: int | None = None) -> dict:
    """Weight bytes a step moves: {"read": stored bytes read, "dequantized": weights (whole, or gathered
    rows) dequantized outside kernels (bf16 values, written and read back by the dot: 4 bytes a value), "relayout":
    whole-weight copies made for a kernel (written and read: twice their bytes), "total", and the
    stored bytes read per use}. rows: the step's routed rows (batch x top-k): the grouped expert
    kernel reads min(E, rows) of a stack's E experts (the non-empty ones; at most that many)."""
    read = dequant = relayout = 0
    by_use = {"kernel": 0, "dequantized": 0, "gathered": 0}
    for u in uses:
        if u.kernels:
            b = u.stored_bytes
            if rows is not None and "['experts']" in u.name:
                E = u.shape[0]
                b = u.stored_bytes * min(E, rows) // E
            kind = "kernel"
        elif u.dequantized:
            b, kind = u.stored_bytes, "dequantized"
            dequant += 4 * u.elements * (2 if u.packed else 1)
        else:
            b, kind = u.gathered_bytes, "gathered"
        if not u.kernels:
            dequant += 4 * u.gathered_values  # gathered rows dequantized (bf16 written, read back)
        read += b
        by_use[kind] += b
        relayout += 2 * u.relayout_bytes
    return {"read": read, "dequantized": dequant, "relayout": relayout, "total": read + dequant + relayout,
            "by_use": by_use}


KV_PARTS = ("window", "compressed", "index_keys")  # a serving cache's KV rows (`model.cache.init_cache`)


def kv_cache_uses(closed, first: int, cache: dict) -> list[WeightUse]:
    """The KV caches' uses in a traced step whose inputs from `first` on are the cache's leaves (a
    jitted step's `.trace(params, tokens, cache, ...)`: first = params' leaves + 1): each KV array
    followed as a weight is, rows written into it (an in-place update) keeping it itself.
    `relayout_bytes` > 0: a copy of the array made for a kernel outside it (e.g. the 8-bit rows
    regrouped into the TPU kernels' 32-bit words on every call)."""
    out = {}
    for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(cache)):
        if isinstance(path[0], jax.tree_util.DictKey) and path[0].key in KV_PARTS:
            nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
            out[first + i] = WeightUse(jax.tree_util.keystr(path), tuple(leaf.shape), nbytes, nbytes)
    follow(closed.jaxpr, {closed.jaxpr.invars[i]: Taint(u, True, u.elements) for i, u in out.items()})
    return list(out.values())

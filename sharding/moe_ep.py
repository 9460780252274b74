"""Expert-parallel MoE: routed experts split over a mesh axis, tokens sent to them and back.

The gate (`MoE.route`), the slot order and the final sum (`MoE.slots`, `MoE.combine`) are the
unsharded `MoE`'s own (dsv41_jax/layers/moe.py), run under GSPMD; only the routed-expert step
(`MoE.apply`'s expert math) runs inside `shard_map`:

1. token rows are split over *every* mesh axis (no device repeats another's expert work);
2. each (row, slot) pair goes to the device that owns its expert (`expert // experts_per_device`
   along the expert axis) with an all-to-all, and comes back the same way;
3. the owner runs the experts' math (`Experts.per_row` or `Experts.grouped`, on its local slice).

Two exchanges:
- "dense": `all_to_all` of fixed-capacity buffers. The capacity is the worst case
  (every pair of a device goes to one owner: rows x min(k, experts per device)), so no
  token is ever dropped; it moves padding, which is fine for decode-sized batches and is
  the only choice on CPU (XLA:CPU has no ragged all-to-all).
- "ragged": `jax.lax.ragged_all_to_all` moves only the real pairs (TPU/GPU). Its offset
  bookkeeping is tested on CPU through `_emulated_ragged_all_to_all`, a slow stand-in built
  from all_gather.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from dsv41_jax.layers.moe import MoE
from dsv41_jax.model.stack import blocks
from sharding.compat import has_ragged_all_to_all, shard_map

DISPATCH = ("auto", "dense", "ragged", "ragged-emulated")


def _axis_size(mesh: Mesh, axis: str) -> int:
    return dict(zip(mesh.axis_names, mesh.devices.shape)).get(axis, 1)


def _check_split(n_experts: int, mesh: Mesh, expert_axis: str, dispatch: str) -> None:
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch must be one of {DISPATCH}, got {dispatch!r}")
    n_ep = _axis_size(mesh, expert_axis)
    if n_experts % n_ep:
        raise ValueError(f"{n_experts} routed experts cannot be split evenly over mesh axis {expert_axis!r} of size "
                         f"{n_ep}; pick an expert axis size that divides {n_experts}")


def expert_parallel_apply(moe: MoE, x: jax.Array, scores: jax.Array, experts: jax.Array, mesh: Mesh, *,
                          mode: str = "fast", expert_axis: str = "expert", dispatch: str = "auto",
                          impl: str = "xla", interpret: bool = False, chunk_rows: int | None = None):
    """`MoE.apply` with the routed experts split over `expert_axis`: the same slots (weights, ascending
    expert order), the same fp32 sum and shared expert; only the expert math runs in `routed_outputs`.
    x [B,T,d], scores [B,T,E] (route's), experts [B,T,k] (the decided ones) -> (y [B,T,d], info).
    impl, interpret: resolved, as `MoE.apply` takes them (impl "pallas": the FP4 expert kernel per device).
    chunk_rows: `routed_outputs`'s."""
    _check_split(moe.experts.w1.shape[0], mesh, expert_axis, dispatch)
    B, T, d = x.shape
    k = experts.shape[-1]
    weights, e_sorted, w_sorted = moe.slots(scores, experts, mode)
    # the unsharded MoE's choice, so both compute the same numerics; a device's receive buffer
    # (expert-axis size x its rows x min(k, local experts)) never holds more than the B*T*k rows here
    per_row = mode == "exact" or B * T * k <= moe.grouped_threshold
    out = routed_outputs(moe.experts, x.reshape(B * T, d), e_sorted, w_sorted, mesh, mode=mode,
                         expert_axis=expert_axis, dispatch=dispatch, per_row=per_row,
                         kernel=_kernel_choice(moe.experts, mode, impl, interpret), chunk_rows=chunk_rows)
    return moe.combine(x, out, scores, experts, weights, mode)


def expert_parallel_moe(moe: MoE, x: jax.Array, mesh: Mesh, *, mode: str = "fast", forced=None,
                        expert_axis: str = "expert", dispatch: str = "auto"):
    """Drop-in for `moe(x, mode)`: the unsharded gate (`MoE.route`), then `expert_parallel_apply`.
    forced: optional expert ids [B,T,k] run instead of the gate's choice (as a probe's decision would)."""
    _check_split(moe.experts.w1.shape[0], mesh, expert_axis, dispatch)
    scores, _, experts = moe.route(x, mode)
    experts = experts if forced is None else forced.astype(experts.dtype)
    return expert_parallel_apply(moe, x, scores, experts, mesh, mode=mode, expert_axis=expert_axis, dispatch=dispatch)


def _kernel_choice(experts_module, mode, impl, interpret):
    """interpret (bool) when the devices run the FP4 expert kernel (`MoE.apply`'s choice), else None."""
    return bool(interpret) if mode != "exact" and impl == "pallas" and experts_module.kind == "fp4" else None


def routed_outputs(experts_module, rows: jax.Array, expert_ids: jax.Array, weights: jax.Array, mesh: Mesh, *,
                   mode: str = "fast", expert_axis: str = "expert", dispatch: str = "auto", per_row: bool = True,
                   kernel: bool | None = None, chunk_rows: int | None = None):
    """Weighted outputs of each row's experts: rows [N, d], expert_ids/weights [N, k] -> [N, k, d].

    An expert id < 0 marks an empty slot (output 0). per_row: each device runs `Experts.per_row`
    (else `Experts.grouped`) on the rows it receives. kernel: not None, each device runs the FP4
    expert kernel (`expert_gemm_moe`; kernel = its interpret flag) on its own experts' stacks (the
    stored bytes or the word views `kernel_params` made: E leads both, so each device holds its
    experts' views only).
    chunk_rows: at most this many of a device's rows go through one exchange: a device's rows are
    split into equal chunks (padded) of at most that many, run one after another, each under `jax.checkpoint` (the backward
    recomputes a chunk's exchange and expert math from its rows). Why: the receive buffers are sized
    for the worst case, expert-axis size x the rows x min(k, local experts), 16 x 6 = 96 rows per row
    on the released model over expert=16: a training step's 1,024 rows per device fill 98,304 buffer
    rows (1 GB in bf16 per buffer, with the expert math's intermediates several times that). Each
    (row, slot) pair's output is computed by the same math whatever chunk it is in, so the outputs
    and the rows' gradients are the unchunked ones bit for bit; the experts' weight gradients are
    summed over the chunks in the weights' dtype (bf16 in training), as the data axis sums the
    devices' parts. None: one exchange for all rows (serving's decode and prefill).
    """
    _check_split(experts_module.w1.shape[0], mesh, expert_axis, dispatch)
    N, d = rows.shape
    n_ep = _axis_size(mesh, expert_axis)
    if dispatch == "auto":
        dispatch = "ragged" if has_ragged_all_to_all() else "dense"
    axes = tuple(mesh.axis_names)
    n_shards = math.prod(mesh.devices.shape)
    chunks = _chunks(-(-N // n_shards), chunk_rows)
    pad = -N % (n_shards * chunks)  # every device gets the same number of rows, split into equal chunks
    if pad:
        rows = jnp.pad(rows, ((0, pad), (0, 0)))
        expert_ids = jnp.pad(expert_ids, ((0, pad), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    graphdef, state = nnx.split(experts_module)
    ep = expert_axis if n_ep > 1 else None
    body = functools.partial(_device_step, graphdef, ep=ep, n_ep=n_ep, mode=mode, dispatch=dispatch,
                             per_row=per_row if kernel is None else ("kernel-interpret" if kernel else "kernel"),
                             pairs=N * expert_ids.shape[1], chunks=chunks)
    token_spec = P(axes)
    step = shard_map(body, mesh=mesh, in_specs=(token_spec, token_spec, token_spec, P(ep)), out_specs=token_spec)
    out = step(rows, expert_ids.astype(jnp.int32), weights.astype(jnp.float32), state)
    return out[:N]


def _chunks(rows: int, chunk_rows: int | None) -> int:
    """How many chunks a device's `rows` are split into so that none holds more than `chunk_rows`."""
    if chunk_rows is None:
        return 1
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive number of rows or None, got {chunk_rows!r}")
    return max(1, -(-rows // chunk_rows))


def _local_experts(local, x, ids, w, mode, per_row, pairs=None):
    """The experts' own math on this device's slice; ids < 0 are padding (output 0).
    per_row: True `Experts.per_row`, False `Experts.grouped`, "kernel" / "kernel-interpret" the FP4
    expert kernel (`expert_gemm_moe`, compiled / interpreted), in the rows' dtype as `MoE.apply` has it.
    pairs: how many real (row, slot) pairs the whole mesh has; when fewer than x's rows, only that
    many rows (the real ones first) are computed: the receive buffers are sized for the worst case
    per owner (at decode 96 rows per device for B=1's 6 pairs), and the XLA math gathers and
    dequantizes a whole expert per row."""
    if pairs is not None and pairs < x.shape[0]:
        keep = jnp.argsort(ids < 0, stable=True)[:pairs]  # the real rows first, in their order
        out = _local_experts(local, x[keep], ids[keep], w[keep], mode, per_row)
        return jnp.zeros((x.shape[0],) + out.shape[1:], out.dtype).at[keep].set(out)
    valid = ids >= 0
    if isinstance(per_row, str):
        from pallas_kernels import expert_gemm_moe  # noqa: WPS433 (optional dependency on the kernels)

        # ids == n_local sort last and are left out of the group sizes: the kernel gives them zeros
        out = expert_gemm_moe(local, x, jnp.where(valid, ids, local.w1.shape[0]), jnp.where(valid, w, 0.0),
                              interpret=per_row == "kernel-interpret")
    elif per_row:
        out = local.per_row(x, jnp.maximum(ids, 0), jnp.where(valid, w, 0.0), mode)
    else:
        # ids == n_local are left out of the group sizes, so ragged_dot gives them zeros
        out = local.grouped(x, jnp.where(valid, ids, local.w1.shape[0]), w, mode)
    return jnp.where(valid[:, None], out, jnp.zeros_like(out))


def _device_step(graphdef, x, ids, w, state, *, ep, n_ep, mode, dispatch, per_row, pairs, chunks=1):
    """One device: rows x [n, d] with their k expert ids/weights -> weighted expert outputs [n, k, d];
    with chunks > 1, n/chunks rows at a time (`routed_outputs`' chunk_rows)."""
    if chunks > 1:
        n, k = ids.shape
        one = jax.checkpoint(functools.partial(_device_step, graphdef, ep=ep, n_ep=n_ep, mode=mode, dispatch=dispatch,
                                               per_row=per_row, pairs=pairs))
        split = lambda a: a.reshape((chunks, n // chunks) + a.shape[1:])  # noqa: E731
        out = jax.lax.map(lambda c: one(*c, state), (split(x), split(ids), split(w)))
        return out.reshape(n, k, -1)
    local = nnx.merge(graphdef, state)
    n, k = ids.shape
    if ep is None:  # every expert is here
        out = _local_experts(local, jnp.repeat(x, k, axis=0), ids.reshape(-1), w.reshape(-1), mode, per_row, pairs)
        return out.reshape(n, k, -1)
    e_local = local.w1.shape[0]
    pe, pw = ids.reshape(-1), w.reshape(-1)
    valid = pe >= 0
    dest = jnp.where(valid, pe // e_local, 0)
    local_id = jnp.where(valid, pe - dest * e_local, -1)
    row = jnp.arange(n * k) // k
    if dispatch == "dense":
        out = _dense_exchange(local, x, row, dest, local_id, pw, valid, ep=ep, n_ep=n_ep, cap=n * min(k, e_local),
                              mode=mode, per_row=per_row, pairs=pairs)
    else:
        a2a = jax.lax.ragged_all_to_all if dispatch == "ragged" else _emulated_ragged_all_to_all
        out = _ragged_exchange(local, x, row, dest, local_id, pw, valid, ep=ep, n_ep=n_ep, cap=n * min(k, e_local),
                               mode=mode, per_row=per_row, a2a=a2a, pairs=pairs)
    return out.reshape(n, k, -1)


def _dense_exchange(local, x, row, dest, local_id, pw, valid, *, ep, n_ep, cap, mode, per_row, pairs):
    """Fixed-capacity buffers [n_ep, cap, ...]: pair i sits at (dest_i, rank among pairs to dest_i)."""
    m = row.shape[0]
    onehot = (dest[:, None] == jnp.arange(n_ep)[None]) & valid[:, None]
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
    pos = jnp.where(valid, pos, cap)  # out of range: dropped by the scatter
    d = x.shape[-1]
    send_x = jnp.zeros((n_ep, cap, d), x.dtype).at[dest, pos].set(x[row], mode="drop")
    send_id = jnp.full((n_ep, cap), -1, jnp.int32).at[dest, pos].set(local_id, mode="drop")
    send_w = jnp.zeros((n_ep, cap), jnp.float32).at[dest, pos].set(pw, mode="drop")
    a2a = functools.partial(jax.lax.all_to_all, axis_name=ep, split_axis=0, concat_axis=0)
    recv_x, recv_id, recv_w = a2a(send_x), a2a(send_id), a2a(send_w)
    out = _local_experts(local, recv_x.reshape(n_ep * cap, d), recv_id.reshape(-1), recv_w.reshape(-1), mode, per_row,
                         pairs)
    back = a2a(out.reshape(n_ep, cap, d))
    got = back[dest, jnp.minimum(pos, cap - 1)]
    return jnp.where(valid[:, None], got, jnp.zeros_like(got)).reshape(m, d)


def _ragged_exchange(local, x, row, dest, local_id, pw, valid, *, ep, n_ep, cap, mode, per_row, a2a, pairs):
    """Pairs sorted by owner; only real pairs travel. Buffers are sized for the worst case."""
    m, d = row.shape[0], x.shape[-1]
    key = jnp.where(valid, dest, n_ep)  # invalid pairs last, never sent
    order = jnp.argsort(key, stable=True)
    send_sizes = jnp.bincount(key, length=n_ep).astype(jnp.int32)
    in_off = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    small = functools.partial(jax.lax.all_to_all, axis_name=ep, split_axis=0, concat_axis=0)
    recv_sizes = small(send_sizes[:, None])[:, 0]
    recv_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    out_off = small(recv_off[:, None])[:, 0]  # where my chunk lands in each owner's buffer
    src_off = small(in_off[:, None])[:, 0]  # where each source keeps the pairs it sent me
    buf = n_ep * cap
    xs = x[row[order]]
    meta = jnp.stack([local_id[order], jax.lax.bitcast_convert_type(pw[order], jnp.int32)], axis=-1)
    recv_x = a2a(xs, jnp.zeros((buf, d), x.dtype), in_off, send_sizes, out_off, recv_sizes, axis_name=ep)
    recv_meta = a2a(meta, jnp.zeros((buf, 2), jnp.int32), in_off, send_sizes, out_off, recv_sizes, axis_name=ep)
    filled = jnp.arange(buf) < jnp.sum(recv_sizes)
    ids = jnp.where(filled, recv_meta[:, 0], -1)
    wts = jax.lax.bitcast_convert_type(recv_meta[:, 1], jnp.float32)
    out = _local_experts(local, recv_x, ids, wts, mode, per_row, pairs)
    back = a2a(out, jnp.zeros((m, d), out.dtype), recv_off, recv_sizes, src_off, send_sizes, axis_name=ep)
    got = jnp.zeros((m, d), out.dtype).at[order].set(back)
    return jnp.where(valid[:, None], got, jnp.zeros_like(got))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`ragged_all_to_all` semantics from all_gather (slow; lets CPU tests check the offsets).

    Peer s sends rows [input_offsets_s[j], +send_sizes_s[j]) of its operand to peer j, which
    stores them at [output_offsets_s[j], +send_sizes_s[j]) of its output.
    """
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [n, m, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [n] offsets of what s sends me
    size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        inside = (r >= out_off[s]) & (r < out_off[s] + size[s])
        src = jnp.clip(in_off[s] + r - out_off[s], 0, ops.shape[1] - 1)
        rows = ops[s][src]
        mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(mask, rows.astype(output.dtype), output)
    del recv_sizes  # implied by the senders' sizes
    return output


# ------------------------------------------------------------------------------- model wiring
class ExpertParallelMoE(MoE):
    """The same parameters as a `MoE` (gate, experts, shared_experts), run expert-parallel: `route`
    (and `__call__`) are the MoE's own, `apply` is `expert_parallel_apply`.

    Parameter paths are unchanged, so a model using it shares its params pytree and
    shardings with the plain model.
    """

    def __init__(self, moe: MoE, mesh: Mesh, expert_axis: str = "expert", dispatch: str = "auto",
                 chunk_rows: int | None = None):
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.topk, self.grouped_threshold = moe.topk, moe.grouped_threshold
        self.mesh, self.expert_axis, self.dispatch, self.chunk_rows = mesh, expert_axis, dispatch, chunk_rows

    def apply(self, x, scores, experts, mode, impl="xla", interpret=False):
        return expert_parallel_apply(self, x, scores, experts, self.mesh, mode=mode, expert_axis=self.expert_axis,
                                     dispatch=self.dispatch, impl=impl, interpret=interpret, chunk_rows=self.chunk_rows)


def with_expert_parallel(model, mesh: Mesh, *, expert_axis: str = "expert", dispatch: str = "auto",
                         chunk_rows: int | None = None):
    """A copy of `model` (sharing its arrays) whose MoE layers run expert-parallel on `mesh`.

    Works on abstract models (nnx.eval_shape) too. Use `nnx.split` on the result to get the
    graphdef for `dsv41_jax.model.transformer.make_step`; the params pytree is the plain model's.
    chunk_rows: `routed_outputs`'.
    """
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    for block in blocks(copy):  # a stack of layers (`LayerStack`) once
        block.ffn = ExpertParallelMoE(block.ffn, mesh, expert_axis, dispatch, chunk_rows)
    return copy

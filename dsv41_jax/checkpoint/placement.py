"""Putting host data onto devices with a target sharding, reading only what each device needs.

The loaders describe a parameter by (shape, dtype, read) where `read(index)` returns the host
block for a tuple of slices. `place` asks the sharding which block each addressable device
holds, reads every distinct block once, and assembles the global array. A block that goes to
one device and is larger than `chunk_bytes` is streamed in row chunks into a donated device
buffer, so host memory holds one chunk instead of the whole block (and on CPU, where device
memory is host memory, the block is never held twice). A replicated block is read once and
copied to each of its devices.

A sharding spec is what `load_checkpoint(shardings=...)` accepts: None (everything on the
first device), one `jax.sharding.Sharding` for every parameter, or a callable
`(path, shape, dtype) -> Sharding` — the hook the sharding rules plug into.
"""
from __future__ import annotations

import functools
from typing import Callable, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from dsv41_jax.checkpoint.safetensors_file import normalize_index

ShardingFn = Callable[[tuple, tuple, np.dtype], Sharding]
ShardingSpec = Union[None, Sharding, ShardingFn]
Reader = Callable[[tuple], np.ndarray]
CHUNK_BYTES = 16 << 20


def first_device(path: tuple, shape: tuple, dtype) -> Sharding:
    """The default placement: every parameter on the first device."""
    return SingleDeviceSharding(jax.devices()[0])


def replicated(mesh: Mesh) -> ShardingFn:
    """Every parameter replicated on every device of `mesh` (the simple data-parallel layout)."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return lambda path, shape, dtype: sharding


def data_mesh(n_devices: int) -> Mesh:
    """A one-axis ("data",) mesh over the first n devices."""
    devices = jax.devices()
    if not 1 <= n_devices <= len(devices):
        raise ValueError(f"asked for {n_devices} devices but {len(devices)} are visible "
                         f"({jax.default_backend()}); use 1..{len(devices)}")
    return Mesh(np.array(devices[:n_devices]), ("data",))


def resolve(shardings: ShardingSpec) -> ShardingFn:
    if shardings is None:
        return first_device
    if isinstance(shardings, Sharding):
        return lambda path, shape, dtype: shardings
    if callable(shardings):
        return shardings
    raise TypeError(f"shardings must be None, a jax.sharding.Sharding or a callable (path, shape, dtype) -> Sharding; "
                    f"got {type(shardings).__name__}")


@functools.lru_cache(maxsize=None)
def _updater(device):
    """A jitted in-place row update of a buffer on `device` (the buffer is donated)."""
    out = SingleDeviceSharding(device)

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=out)
    def update(buf, rows, start):
        return jax.lax.dynamic_update_slice_in_dim(buf, rows, start, 0)

    return update


def _streamed(dtype, index, device, read: Reader, chunk_bytes: int) -> jax.Array:
    """Fill one block on one device chunk by chunk; the last chunk overlaps the previous one so
    every chunk has the same shape (one compile per block shape and device)."""
    (r0, r1), rest = index[0], index[1:]
    n = r1 - r0
    row_bytes = np.dtype(dtype).itemsize * int(np.prod([b - a for a, b in rest], dtype=np.int64))
    per = int(min(n, max(1, chunk_bytes // max(1, row_bytes))))
    buf = jnp.zeros((n,) + tuple(b - a for a, b in rest), dtype, device=SingleDeviceSharding(device))
    tail = tuple(slice(a, b) for a, b in rest)
    update = _updater(device)
    for c0 in range(0, n, per):
        c0 = min(c0, n - per)
        host = read((slice(r0 + c0, r0 + c0 + per),) + tail)
        buf = update(buf, jax.device_put(host, device), np.int32(c0))
        buf.block_until_ready()  # one chunk in flight: host memory stays at one chunk
        del host
    return buf


def place(shape: tuple, dtype, sharding: Sharding, read: Reader, *, chunk_bytes: int | None = None) -> jax.Array:
    """A global array with `sharding` whose blocks come from `read(index)` (index: tuple of slices)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    by_block: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_block.setdefault(normalize_index(index, shape), []).append(device)
    pieces = []
    for block, devices in by_block.items():
        nbytes = dtype.itemsize * int(np.prod([b - a for a, b in block], dtype=np.int64))
        if len(devices) == 1 and block and nbytes > chunk_bytes and block[0][1] - block[0][0] > 1:
            pieces.append((devices[0], _streamed(dtype, block, devices[0], read, chunk_bytes)))
            continue
        host = np.asarray(read(tuple(slice(a, b) for a, b in block)))
        if host.dtype != dtype:
            raise TypeError(f"reader returned {host.dtype}, expected {dtype}")
        pieces.extend((d, jax.device_put(host, d)) for d in devices)
        del host
    if isinstance(sharding, SingleDeviceSharding):
        return pieces[0][1]
    return jax.make_array_from_single_device_arrays(shape, sharding, [p for _, p in pieces])

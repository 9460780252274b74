"""A multi-process smoke test: run it on every host of a slice before serving.

    python -m sharding.multihost_check --coordinator HOST0:PORT --num-processes N --process-id I [--mesh SPEC]

Each process joins `jax.distributed`, builds the global mesh over every process's devices and
runs the expert-parallel MoE of a tiny config on it (all-to-all across processes), then
compares the result with the same MoE computed on its own first device. It prints one JSON line
and exits 0 when they agree. On CPU (the test suite) the processes talk over loopback with gloo.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sharding.multihost_check")
    p.add_argument("--coordinator", required=True, help="host:port of process 0")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--mesh", default="data=-1,expert=2", help="mesh over all processes' devices")
    a = p.parse_args(argv)

    # deferred: the distributed runtime is joined before anything else touches jax
    from sharding.mesh import init_distributed

    init_distributed(a.coordinator, a.num_processes, a.process_id)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    # deferred: the distributed runtime is joined before anything else touches jax
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.layers.moe import MoE
    from sharding.mesh import make_mesh, mesh_shape
    from sharding.moe_ep import expert_parallel_moe

    mesh = make_mesh(a.mesh)
    # bf16 weights: nothing to quantize at init, so the check starts fast
    cfg = ModelConfig.tiny(engram_layer_ids=(), n_routed_experts=8, n_activated_experts=2, dtype="bf16", expert_dtype=None)
    moe = MoE(cfg, rngs=nnx.Rngs(0))  # same seed on every process: same weights
    x = np.asarray(jax.random.normal(jax.random.key(1), (4, 3, cfg.dim)).astype(jnp.bfloat16))

    # the reference, on this process's first device only
    local = jax.jit(lambda x: moe(x, "fast")[0])(x)

    def global_replicated(arr):
        arr = np.asarray(arr)
        return jax.make_array_from_callback(arr.shape, NamedSharding(mesh, P()), lambda idx: arr[idx])

    graphdef, state = nnx.split(moe)
    state_g = jax.tree.map(global_replicated, state)

    @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P()))  # every process gets all rows
    def run(state, x):
        return expert_parallel_moe(nnx.merge(graphdef, state), x, mesh, mode="fast", dispatch="dense")[0]

    out = run(state_g, global_replicated(x))
    got = np.asarray(out.addressable_data(0)).astype(np.float32)
    want = np.asarray(local).astype(np.float32)
    err = float(np.max(np.abs(got - want)))
    ok = err <= 1e-2 * float(np.max(np.abs(want)))
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                      "mesh": mesh_shape(mesh), "max_abs_err": err, "ok": ok}), flush=True)
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

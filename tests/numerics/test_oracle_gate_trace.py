"""The oracle's own DSpark gate scores (golden/README.md, `trace.dspark.stage{k}.gate_scores`) equal
sqrt(softplus(s)) computed with torch's *scalar* softplus (glibc expf + log1pf: each stage's call
is [5, 4] = 20 elements, shorter than one AVX-512 vector step) and MKL's sqrt (`numerics/mkl_sqrt`),
on all 3 x 20 x 20 = 1200 values. The IEEE sqrt and the SLEEF softplus are shown to be
distinguishable here (they miss 186 and 68 of them), so the test could fail.

s = the stage's gate logits: the traced bf16 FFN input times the bf16 gate weight, summed in
float64 and rounded once to float32 (the oracle's exact linear, oracle README choice 2).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.numerics import activations
from dsv41_jax.numerics.exact_ops import exact_sqrt
from dsv41_jax.numerics.mkl_sqrt import sqrt_mkl


def _gate_logits_and_scores(golden_root):
    from safetensors import safe_open

    folder = golden_root / "dspark_fp8"
    case = folder / "dspark_P40_S20.safetensors"
    if not case.exists():
        pytest.skip(f"{case} not found (the traced DSpark case)")
    with safe_open(str(case), "flax") as f:
        names = [k for k in f.keys() if k.startswith("trace.dspark.stage") and k.endswith(("ffn_input", "gate_scores"))]
        tr = {k: np.asarray(f.get_tensor(k)) for k in names}
    with safe_open(str(folder / "weights.safetensors"), "flax") as f:
        w = {k: np.asarray(f.get_tensor(k)) for k in f.keys() if k.startswith("mtp.") and k.endswith("ffn.gate.weight")}
    out = []
    for k in range(len(w)):
        x = tr[f"trace.dspark.stage{k}.ffn_input"].astype(np.float64)
        s = (x @ w[f"mtp.{k}.ffn.gate.weight"].astype(np.float64).T).astype(np.float32)
        out.append((s, tr[f"trace.dspark.stage{k}.gate_scores"]))
    return out


def test_dspark_gate_scores_are_glibc_softplus_then_mkl_sqrt(golden_root):
    stages = _gate_logits_and_scores(golden_root)
    with jax.enable_x64(True):
        equal = {"glibc+mkl": 0, "glibc+ieee": 0, "sleef+mkl": 0}
        total = 0
        for s, ref in stages:
            sj = jnp.asarray(s)
            got = {"glibc+mkl": sqrt_mkl(activations.softplus_scalar(sj)),
                   "glibc+ieee": exact_sqrt(activations.softplus_scalar(sj)),
                   "sleef+mkl": sqrt_mkl(activations.softplus(sj, "exact"))}
            for name, v in got.items():
                equal[name] += int(np.sum(np.asarray(v).view(np.uint32) == ref.view(np.uint32)))
            total += ref.size
    assert total == 1200
    assert equal["glibc+mkl"] == total, equal
    assert equal["glibc+ieee"] < total and equal["sleef+mkl"] < total, equal  # the check can tell them apart

"""No exact-mode number depends on the host's CPU.

numpy 2.x picks SIMD code per CPU at import (AVX-512 hosts run numpy's own float32 pow, exp, log;
others call the C library), and XLA compiles for the host's instruction set. The RoPE tables and
the exact elementwise emulations must come out bit-identical either way: this runs
tests/support/host_numerics_digest.py as found and in subprocesses with numpy's AVX-512 (then also AVX2)
dispatch disabled and XLA's CPU codegen capped to the same level, and compares the digests. On a
host without AVX-512 the subprocess runs take the same paths, and the test still guards against
an in-process/subprocess difference; the AVX-512 case is what the CI machines may or may not be.
"""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DIGEST = REPO / "tests" / "support" / "host_numerics_digest.py"


def _known_features(names):
    """The names this numpy knows (NPY_DISABLE_CPU_FEATURES rejects names it has never heard of
    on some versions); X86_V4/X86_V3 exist from numpy 2.4, AVX512_SKX/AVX512F before."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return " ".join(n for n in names if n in __cpu_features__)


def _run(env_extra, golden):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    res = subprocess.run([sys.executable, str(DIGEST)] + ([str(golden)] if golden else []), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=1)
def _found(golden):
    """The digests with the dispatch as found, in a subprocess like the others: computing them in the test
    process turned on jax_enable_x64 and refilled the RoPE table cache for every later test on the worker
    (test_model's fast prefill-vs-decode cache bytes then differed)."""
    return _run({}, golden)


@pytest.mark.parametrize("level", ["no_avx512", "baseline"])
def test_tables_and_elementwise_bits_do_not_depend_on_numpy_dispatch(level):
    golden = Path(os.environ.get("DSV41_GOLDEN_DIR", REPO.parent / "shared" / "golden"))
    golden = golden if golden.is_dir() else None  # the stored configs' settings join the fixed ones
    found = _found(str(golden) if golden else None)
    off = ["AVX512_SPR", "AVX512_ICL", "AVX512_CLX", "AVX512_CNL", "AVX512_SKX", "AVX512F", "X86_V4"]
    isa = "AVX2"
    if level == "baseline":
        off += ["X86_V3", "AVX2", "FMA3"]
        isa = "SSE4_2"
    xla = (os.environ.get("XLA_FLAGS", "") + f" --xla_cpu_max_isa={isa}").strip()
    limited = _run({"NPY_DISABLE_CPU_FEATURES": _known_features(off), "XLA_FLAGS": xla}, golden)
    assert found.keys() == limited.keys()
    differ = sorted(k for k in found if found[k] != limited[k])
    assert not differ, f"bits depend on the host CPU ({level}): {differ}"

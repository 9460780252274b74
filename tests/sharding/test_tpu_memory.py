"""Which memory figure XLA:TPU enforces: programs on one v5p chip brought to either side of its limit.

Runs `python -m sharding.tpu_memory` in a child process (libtpu aborts its process on a failed
internal check; the child also starts clean of this session's CPU-device flags).
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from pallas_kernels.common import tpu_compile

pytestmark = pytest.mark.skipif(tpu_compile.libtpu_missing() is not None, reason=str(tpu_compile.libtpu_missing()))
ROOT = pathlib.Path(__file__).resolve().parents[2]
GiB = 2 ** 30


def test_the_compiler_refuses_where_live_arguments_and_temporaries_pass_its_limit_and_its_peak_counts_them():
    """Just under 95.74 GiB of live arguments + temporaries compiles and `compiler_peak` (the figure
    `dsv41 compile`'s verdict takes) is those bytes (and the 4-byte result, padded: 1 kB); just over
    is refused, the message quoting the same bytes. So the refusal and the verdict count the same
    thing (on the QAT training step the summed figure is 18-35 GB more than both, and that step
    compiles: docs/PERFORMANCE.md). Two one-chip compiles of a few ops, 1.6 s."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), XLA_FLAGS="",
               **tpu_compile.ENV)
    proc = subprocess.run([sys.executable, "-m", "sharding.tpu_memory"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    under, over = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    live = under["arguments"] + under["temporaries"]
    assert under["refused"] is None and 0 <= under["compiler_peak"] - live <= 2 ** 20, under
    assert under["fit"] == under["compiler_peak"] + under["generated_code"], under
    assert under["argument"] == under["arguments"] and abs(under["temp"] - under["temporaries"]) <= 2 ** 20, under
    limit = float(re.search(r"exceeds available HBM \(([\d.]+)G\)", over["refused"]).group(1)) * GiB
    quoted = float(re.search(r"HLO temporaries \(([\d.]+)G\)", over["refused"]).group(1)) * GiB
    assert live <= limit < over["arguments"] + over["temporaries"], (live, limit, over)
    assert abs(quoted - (over["arguments"] + over["temporaries"])) < 0.01 * GiB, over

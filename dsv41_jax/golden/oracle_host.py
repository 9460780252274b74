"""Running the oracle on a host other than the one that made the shared golden set.

The shared golden tensors come from torch 2.14.1 on an AMD EPYC (AVX-512) host, and exact mode
emulates the two MKL functions the oracle calls there (docs/NUMERICS.md): `torch.exp` (the
oracle's `sparse_attn`) and float32 `torch.sqrt` (the sqrtsoftplus gate, the Engram gate). MKL
picks its kernels per CPU vendor: on AMD it runs its SSE4.2 kernels (`..._EXHAynn`), on an Intel
AVX-512 host its AVX-512 ones, which round differently (on 10^6 log-uniform inputs: sqrt 17 %,
exp 1.7 % of results differ from the AMD host's). Two settings make an Intel host's oracle compute
what the AMD host computes:

1. `MKL_ENABLE_INSTRUCTIONS=SSE4_2`: MKL takes the kernels it takes on AMD. `torch.exp` then
   equals the AMD host's on every one of 10^6 inputs. (`AVX2` is not the AMD path: MKL's AVX2
   exp differs on 4.4 %, its AVX2 sqrt is IEEE.)
2. float32 `torch.sqrt` / `Tensor.sqrt` replaced by the same SSE4.2 kernel's arithmetic with the
   AMD host's `rsqrtps` values (`numerics/amd_rsqrtps_table.py`). The kernel seeds its
   Goldschmidt step with `rsqrtps`, a 12-bit approximation whose bits are the CPU vendor's own:
   with this host's own `rsqrtps` (a C loop over `_mm_rsqrt_ss`) the kernel's arithmetic equals
   MKL's SSE4.2 `torch.sqrt` here on all 10^6 inputs, but Intel's `rsqrtps` is not AMD's (7.8 %
   of square roots differ), and no MKL setting changes an instruction's result. The replacement
   is that arithmetic in numpy float32 (each step rounded, no fused multiply-add, subnormals kept)
   on the recorded table: on the AMD host it is the identity.

`harness_command` wraps the oracle's harness (and `generator_code` its generators) with both;
both also run the GEMM stand-in in row chunks (same values, bounded memory).
"""
from __future__ import annotations

import os
import pathlib

TABLE = pathlib.Path(__file__).resolve().parents[1] / "numerics" / "amd_rsqrtps_table.py"
ENV = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}

# argv[1]: the rsqrtps table module (read as a file: the oracle's venv has no jax); the rest is
# the wrapped program's command line
_AMD_SQRT = """import base64, runpy, sys
import numpy as np, torch
_v = np.frombuffer(base64.b64decode(''.join(runpy.run_path(sys.argv.pop(1))['TABLE_B64'])), '<u2').astype(np.int64)
_TABLE = ((0x70 | (_v >> 12)) << 23) | ((_v & 0xFFF) << 11)
_f = np.float32

def _rsqrtps(x):
    u = x.view(np.int32).astype(np.int64)
    e = (u >> 23) & 0xFF
    par = (e - 126) & 1
    t = _TABLE[(par << 12) | ((u & 0x7FFFFF) >> 11)] - (((e - 126 - par) // 2) << 23)
    return t.astype(np.int32).view(np.float32)

def _sqrt_amd(x):
    u = x.view(np.int32)
    normal = (u >= 0x00800000) & (u <= 0x7F7FF000)  # MKL's main path; the rest is IEEE there
    xs = np.where(normal, x, _f(1))
    r = _rsqrtps(xs)
    s = xs * r
    h = r * _f(0.5)
    err = _f(0.5) - s * h
    s1 = s * err + s
    h1 = h * err + h
    d = xs - s1 * s1
    with np.errstate(invalid='ignore'):
        return np.where(normal, d * h1 + s1, np.sqrt(x))

_orig = torch.Tensor.sqrt

def _sqrt(t):
    if t.dtype != torch.float32 or t.device.type != 'cpu':
        return _orig(t)
    return torch.from_numpy(_sqrt_amd(np.ascontiguousarray(t.detach().numpy()))).reshape(t.shape)

torch.Tensor.sqrt = _sqrt
torch.sqrt = _sqrt
"""

# The stand-ins' GEMM (kernels._blocked_gemm) holds every float64 block dot of a call at once:
# 11 GB for a 1040-token wq_b at the released width. In row chunks of at most 1 GB it computes the
# same values (each row's block dots are exact and its sum is its own), in bounded memory. The
# generators import the same `kernels` module (from the oracle folder, the working directory), so
# they get the chunked GEMM too.
_CHUNKED_GEMM = """
sys.path.insert(0, '.')
import os, kernels
_whole = kernels._blocked_gemm

def _blocked_gemm(a_vals, a_s, b_vals, b_s_full, blk):
    rows = max(1, int(os.environ.get('ORACLE_GEMM_CHUNK_BYTES', 1 << 30)) // (b_vals.numel() // blk * 8))
    return torch.cat([_whole(a_vals[i:i + rows], a_s[i:i + rows], b_vals, b_s_full, blk)
                      for i in range(0, a_vals.shape[0], rows)]) if a_vals.shape[0] > rows else _whole(a_vals, a_s, b_vals, b_s_full, blk)

kernels._blocked_gemm = _blocked_gemm
"""
_RUN_HARNESS = _CHUNKED_GEMM + """
sys.argv = ['harness.py'] + sys.argv[1:]
runpy.run_path('harness.py', run_name='__main__')
"""


def harness_command(python: str, *args: str) -> list[str]:
    """The oracle's `harness.py ARGS` (run in the oracle folder) with the AMD host's MKL math."""
    return [python, "-c", _AMD_SQRT + _RUN_HARNESS, str(TABLE), *args]


def generator_code(code: str) -> str:
    """A `python -c` program for the oracle's generators (first argument: `TABLE`; run in the oracle
    folder), with the AMD host's float32 sqrt and the chunked GEMM."""
    return _AMD_SQRT + _CHUNKED_GEMM + code


def env() -> dict:
    """The environment of an oracle run: ours, with MKL held to the AMD host's kernels."""
    return {**os.environ, **ENV}

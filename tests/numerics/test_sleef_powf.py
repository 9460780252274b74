"""`numerics.sleef_powf` equals torch 2.14.1's vectorised float32 pow (SLEEF powf_u10, AVX-512), and
`rope_pow` equals torch's `base ** exps` for every RoPE length (SLEEF body + glibc tail).

Default suite: recorded torch results where SLEEF and glibc powf differ (1.8 % of such inputs).
Slow: torch itself on >= 10^7 (x, y) pairs and on the RoPE exponents of many (theta, dim)."""
import numpy as np
import pytest

from dsv41_jax.numerics import libm_powf
from dsv41_jax.numerics.sleef_powf import powf_u10, rope_pow

# (x bits, y bits, torch.pow bits on an AVX-512 CPU), all differing from glibc powf
TRIPLES = [
    (0x49616026, 0x3e2995fa, 0x411b9bea),
    (0x4590f287, 0x3e2fbf36, 0x4088450f),
    (0x49f45148, 0x3f6d953e, 0x492c0cfb),
    (0x4348ea92, 0x3f13a560, 0x41aa58fb),
    (0x48440719, 0x3ebec2e7, 0x42bd18a9),
    (0x467b97f3, 0x3e300b82, 0x40a93260),
    (0x472d85be, 0x3f1ed836, 0x443f4c56),
    (0x465ad047, 0x3f2a2b5a, 0x440e9426),
    (0x452d9c1c, 0x3efa6cbc, 0x424160e3),
    (0x467d25aa, 0x3f535cc7, 0x453ad2da),
    (0x4684e2c4, 0x3c0d3a36, 0x3f8b365d),
    (0x4431c0d4, 0x3eab394b, 0x410fd472),
    (0x49873777, 0x3f0dd39c, 0x450b7e05),
    (0x481a72d0, 0x3f2b7ea5, 0x453dffdb),
    (0x43443ccb, 0x3d5ca4b2, 0x3faa1aee),
    (0x4390ce4b, 0x3d79416e, 0x3fb4b9c6),
    (0x46b319a6, 0x3dca4cab, 0x402c89f1),
    (0x49010280, 0x3f1c0226, 0x454017a5),
    (0x4405b3d9, 0x3e913c08, 0x40be1f6e),
    (0x43f38791, 0x3efb9784, 0x41a7650b),
]


def test_recorded_sleef_results():
    a = np.array(TRIPLES, np.uint32)
    x, y, ref = (a[:, i].view(np.float32) for i in range(3))
    got = powf_u10(x, y)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert not np.array_equal(got, libm_powf.powf(x, y))


def test_rope_pow_splits_body_and_tail():
    exps = np.arange(0, 80, 2, dtype=np.float32) / np.float32(80)  # 40 = 32 vectorised + 8 scalar
    out = rope_pow(1.6e5, exps)
    np.testing.assert_array_equal(out[:32], powf_u10(np.float32(1.6e5), exps[:32]))
    np.testing.assert_array_equal(out[32:], libm_powf.powf(np.float32(1.6e5), exps[32:]))
    np.testing.assert_array_equal(rope_pow(1e4, exps[:16]), libm_powf.powf(np.float32(1e4), exps[:16]))
    with pytest.raises(ValueError, match="positive normal"):
        powf_u10(np.float32(-2.0), np.float32(0.5))


@pytest.mark.slow
def test_powf_u10_and_rope_pow_equal_torch():
    torch = pytest.importorskip("torch", reason="torch CPU is the oracle here (pip install torch==2.14.1)")
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("torch's vector step is 2 x 16 lanes only with AVX-512 (the oracle's capability)")
    torch.set_num_threads(1)
    rng = np.random.default_rng(64)
    total = 0
    for i in range(10):
        n = 1 << 20
        x = np.exp(rng.uniform(-80, 80, n)).astype(np.float32)
        y = rng.uniform(-2, 2, n).astype(np.float32) if i % 2 else rng.uniform(0, 1, n).astype(np.float32)
        if i == 0:
            edges = np.array([1, 1, 2, 2, 1e4, 1.6e5, 1e6, 1e30, 1.2e-38, 0.5], np.float32)
            x[:10], y[:10] = edges, np.array([0, 5, 0.5, -0.5, 0.0625, 0.96875, 0.5, 2.5, 0.5, 60], np.float32)
        ref = torch.pow(torch.from_numpy(x), torch.from_numpy(y)).numpy()
        got = powf_u10(x, y)
        bad = (got.view(np.uint32) != ref.view(np.uint32)) & ~(np.isnan(got) & np.isnan(ref))
        assert not bad.any(), f"{int(bad.sum())} differ, e.g. x={x[bad][:3]} y={y[bad][:3]}"
        total += n
    for base in (1e4, 2e4, 4e4, 1.6e5, 5e5, 1e6, 1e7):
        for dim in range(64, 514, 2):
            exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
            ref = (base ** exps).numpy()
            np.testing.assert_array_equal(rope_pow(base, exps.numpy()).view(np.uint32), ref.view(np.uint32),
                                          err_msg=f"theta {base}, dim {dim}")
            total += exps.numel()
    assert total >= 10_000_000

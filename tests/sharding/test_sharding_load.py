"""Loading a checkpoint by shard onto 8 fake CPU devices (the root conftest provides them).

Oracles: `dsv41 plan`'s per-device weights + Engram bytes for the same preset and mesh (an
independent computation from the abstract model and the rule tables), the files' bytes parsed
straight from the safetensors layout for the values each device holds, and a record of
every block the loader reads from the files (no device's read may cover a whole tensor that
the preset splits).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from dsv41_jax.checkpoint import safetensors_file
from dsv41_jax.checkpoint.hf_writer import write_hf_folder
from dsv41_jax.checkpoint.synthetic import random_entries
from dsv41_jax.model.param_names import flat_params
from dsv41_jax.config import ModelConfig
from sharding.load import load_sharded
from sharding.mesh import make_mesh
from sharding.plan import build_plan

# every layer role of the tiny config; table rows that 8 does not divide, so the padding to equal
# row shards (as the plan counts it) is exercised
CFG = ModelConfig.tiny(engram_num_embeddings=(3001, 3907))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    write_hf_folder(out, CFG, random_entries(CFG, seed=5), max_shard_bytes=1 << 20)
    return out


def _held(model) -> dict:
    """Bytes each device holds, from the arrays' own shards."""
    per: dict = {}
    for var in flat_params(model).values():
        for s in var.get_value().addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return per


@pytest.mark.parametrize("spec", ["expert=4,tensor=2", "data=2,expert=4"])
def test_each_device_holds_the_plans_share(folder, spec, monkeypatch):
    reads = []
    real_read = safetensors_file.SafetensorsFile.read

    def recording_read(self, name, index=None):
        out = real_read(self, name, index)
        reads.append((name, out.size, int(np.prod(self.tensors[name].shape))))
        return out

    monkeypatch.setattr(safetensors_file.SafetensorsFile, "read", recording_read)
    mesh = make_mesh(spec)
    cfg, model, report = load_sharded(folder, mesh, progress=False)
    held = _held(model)
    assert len(held) == 8
    plan = build_plan(CFG, spec, batch=8, context=64)["per_device_bytes"]
    want = plan["weights"] + plan["engram"]
    for d, b in held.items():
        assert abs(b - want) <= 0.05 * want, (d, b, want)
    assert sorted(report.bytes_per_device.values()) == sorted(held.values())
    # the plan and the load agree exactly (same rules, same padding): the 5% is the bound
    assert set(held.values()) == {want}, (set(held.values()), want)

    # the tensors the preset splits are never read whole by one call: the Engram table's rows go
    # over every axis; heads and vocabulary over tensor
    split = ["layers.1.engram.embed.weight"]
    if dict(mesh.shape).get("tensor", 1) > 1:
        split += ["layers.0.attn.wq_b.weight", "embed.weight"]
    for name in split:
        got = [(n_read, total) for n, n_read, total in reads if n == name]
        assert got and max(r for r, _ in got) < got[0][1], (name, got)


def test_values_are_the_files_slices(folder):
    mesh = make_mesh("expert=4,tensor=2")
    cfg, model, report = load_sharded(folder, mesh, progress=False, check_values=False)
    params = flat_params(model)
    import json

    wm = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]

    def disk(name, index):
        """The stored bytes of `name`'s block, parsed straight from the safetensors layout (8-byte
        header length, JSON header, data offsets): independent of the project's reader."""
        import struct

        raw = (folder / wm[name]).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        info = json.loads(raw[8:8 + n])[name]
        a, b = info["data_offsets"]
        itemsize = {"F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BF16": 2, "F32": 4}[info["dtype"]]
        arr = np.frombuffer(raw[8 + n + a: 8 + n + b], np.uint8).reshape(tuple(info["shape"]) + (itemsize,))
        return arr[index]

    # heads split over tensor (FP8 bytes)
    wq = params[("layers", 0, "attn", "wq_b", "weight")].get_value()
    for s in wq.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data).view(np.uint8), disk("layers.0.attn.wq_b.weight", s.index)[..., 0])
    # stacked routed experts split over expert, packed E2M1 bytes kept as bytes
    w1 = params[("layers", 0, "ffn", "experts", "w1")].get_value()
    assert w1.dtype == np.uint8
    for s in w1.addressable_shards:
        e0, e1, _ = s.index[0].indices(w1.shape[0])
        assert e1 - e0 == w1.shape[0] // 4
        for e in range(e0, e1):
            np.testing.assert_array_equal(np.asarray(s.data)[e - e0], disk(f"layers.0.ffn.experts.{e}.w1.weight", slice(None))[..., 0])
    # Engram table: rows over all 8 devices, padded with zero rows past the stored 3001
    t = params[("layers", 1, "engram", "embed")].get_value()
    assert t.shape[0] == 3008 and t.sharding.shard_shape(t.shape)[0] == 376
    full = np.concatenate([np.asarray(s.data) for s in sorted(t.addressable_shards, key=lambda s: s.index[0].start or 0)])
    np.testing.assert_array_equal(full[:3001].view(np.uint8), disk("layers.1.engram.embed.weight", slice(None))[..., 0])
    assert not full[3001:].view(np.uint8).any()
    assert "8 devices hold" in report.summary()


# v41-flash widths (dim 5120, 64 heads of 512, q rank 1280, expert width 2304) on two layers (SWA,
# then Full ratio 1 with indexer, candidate source and Engram); fewer experts, a smaller
# vocabulary and Engram table keep the whole process (all 8 fake devices live in it) near 5.3 GiB
WIDE = ModelConfig.v41_flash().replace(
    n_layers=2, compress_ratios=(0, 1), kv_source_layers=(1,), index_source_layers=(1,), candidate_source_layer=1,
    engram_layer_ids=(1,), engram_num_embeddings=(40001,), vocab_size=16384, n_routed_experts=16, n_mtp_layers=0,
    vision_n_layers=0, max_seq_len=256, max_batch_size=8)

_RSS_PROBE = r"""
import json, sys
import jax
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.param_names import flat_params
from sharding.load import load_sharded
from sharding.mesh import make_mesh

def status(key):  # kB -> bytes, from the kernel's own accounting of this process
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

mesh = make_mesh(sys.argv[2])
jax.device_put(jax.numpy.zeros(8), jax.devices()[7]).block_until_ready()  # every runtime piece up
before = status("VmRSS")
cfg, model, report = load_sharded(sys.argv[1], mesh, progress=False)
peak = status("VmHWM")
held, largest = {}, 0
for var in flat_params(model).values():
    for s in var.get_value().addressable_shards:
        held[str(s.device)] = held.get(str(s.device), 0) + s.data.nbytes
        largest = max(largest, s.data.nbytes)
print(json.dumps({"before": before, "peak": peak, "held": held, "largest": largest}))
"""


@pytest.mark.slow
def test_full_width_load_peak_rss(tmp_path):
    """A full-width checkpoint loaded by shard onto 8 fake devices, in a process of its own: each
    device holds the plan's per-device weights + Engram within 5%, and the process's peak RSS
    (VmHWM) grows by at most what the devices hold plus the largest slice (the issue's bound: the
    host never keeps more than one slice in flight besides what the devices hold)."""
    import json
    import os
    import subprocess
    import sys

    write_hf_folder(tmp_path, WIDE, random_entries(WIDE, seed=3))
    spec = "expert=4,tensor=2"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path), spec], env=env, capture_output=True,
                         text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    plan = build_plan(WIDE, spec, batch=8, context=256)["per_device_bytes"]
    want = plan["weights"] + plan["engram"]
    assert len(r["held"]) == 8
    for dev, n in r["held"].items():
        assert abs(n - want) <= 0.05 * want, (dev, n, want)
    share = sum(r["held"].values())
    grown = r["peak"] - r["before"]
    print(f"devices hold {share / 2**30:.2f} GiB, largest slice {r['largest'] / 2**20:.1f} MiB, "
          f"peak RSS grew {grown / 2**30:.2f} GiB")
    assert grown <= share + r["largest"], (grown, share, r["largest"])

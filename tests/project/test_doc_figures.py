"""Figures in the docs that the code computes are recomputed here, so they cannot go stale
(sharding/README.md said 14.13 GiB of weights per v6e chip after the vision tower
had made it 15.68).

Checked: the "Slices by chip count" table of sharding/README.md (weights + Engram per chip, the
largest batch that fits at each context), the `dsv41 plan` output blocks under it (every memory
line and the largest batch at 64K), the same table in docs/PERFORMANCE.md, and docs/SERVING.md's
plans for one host's devices. The plans are
`sharding.plan.build_plan` / `max_batch` with the commands' `--prefill-chunk 256`; the one-layer
compile lines are measurements, not recomputed. About 15 s: the first plan traces the full
model's shapes, the rest reuse them.
"""
from __future__ import annotations

import functools
import pathlib
import re

from dsv41_jax.config import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "sharding" / "README.md"
PERFORMANCE = REPO / "docs" / "PERFORMANCE.md"
CONTEXTS = {"8 K": 8192, "64 K": 65536, "256 K": 262144, "1 M": 1048576}
GiB = 1 << 30


@functools.lru_cache(maxsize=None)
def _cfg():
    return ModelConfig.v41_flash()


@functools.lru_cache(maxsize=None)
def plan(mesh: str, batch: int, context: int, device: str) -> dict:
    from sharding.plan import build_plan

    return build_plan(_cfg(), mesh, batch=batch, context=context, device=device, chunk=256)


@functools.lru_cache(maxsize=None)
def largest(mesh: str, context: int, device: str, chunk: int = 256, engram: str = "hbm") -> int:
    from sharding.plan import max_batch

    return max_batch(_cfg(), mesh, context=context, device=device, chunk=chunk, engram=engram)


def readme_rows() -> list[dict]:
    """The README's slice table: device, mesh, weights and Engram GiB, and the largest batch per context."""
    rows = []
    for line in README.read_text().splitlines():
        m = re.match(r"\| \d+ × (\w+) \| ([\w=,]+) \| ([\d.]+) \+ ([\d.]+) GiB \|(.*)\|$", line)
        if m:
            batches = [int(c.strip().split()[0]) for c in m.group(5).split("|")]
            rows.append({"device": m.group(1), "mesh": m.group(2), "weights": float(m.group(3)),
                         "engram": float(m.group(4)), "batch": dict(zip(CONTEXTS.values(), batches))})
    assert len(rows) == 4, f"the slice table of {README} changed shape: {rows}"
    return rows


def test_slice_table_weights_and_engram_per_chip():
    for row in readme_rows():
        p = plan(row["mesh"], 1, 65536, row["device"])["per_device_bytes"]
        assert (row["weights"], row["engram"]) == (round(p["weights"] / GiB, 2), round(p["engram"] / GiB, 2)), row


def test_plan_output_blocks_and_the_64k_column():
    text = README.read_text()
    blocks = re.findall(r"mesh ([\w=,]+) \(\d+ devices\), preset inference, batch (\d+), context (\d+) "
                        r"\(prefill chunk 256\), Engram in hbm\n(.*?)\nlargest batch that fits (\w+) at context 65536: (\d+)",
                        text, re.S)
    assert len(blocks) == 4, "the four `dsv41 plan` output blocks of sharding/README.md changed shape"
    for mesh, batch, context, body, device, biggest in blocks:
        d = plan(mesh, int(batch), int(context), device)["per_device_bytes"]
        for name, key in [("weights", "weights"), ("engram", "engram"), ("caches", "cache"),
                          ("activations", "activations"), ("total", "total")]:
            shown = float(re.search(rf"^  {name}\s+([\d.]+) GiB", body, re.M).group(1))
            assert shown == round(d[key] / GiB, 2), (mesh, name, shown, d[key] / GiB)
        assert int(biggest) == largest(mesh, 65536, device), (mesh, biggest)
    for row in readme_rows():
        assert row["batch"][65536] == largest(row["mesh"], 65536, row["device"]), row


def test_performance_table_repeats_the_readme():
    mine = {}
    for line in PERFORMANCE.read_text().splitlines():
        m = re.match(r"\| \d+ x (\w+) \| ([\d.]+) \+ ([\d.]+) GiB \| (\d+) \| (\d+) \| (\d+) \| (\d+)", line)
        if m:
            mine[m.group(1)] = (float(m.group(2)), float(m.group(3)), *(int(g) for g in m.group(4, 5, 6, 7)))
    theirs = {r["device"]: (r["weights"], r["engram"], *r["batch"].values()) for r in readme_rows()}
    assert mine == theirs


def test_slice_table_every_context_and_footnotes():
    for row in readme_rows():
        for context, shown in row["batch"].items():
            assert shown == largest(row["mesh"], context, row["device"]), (row["device"], context)
    h200 = next(r for r in readme_rows() if r["device"] == "H200")
    m = re.search(r"8×H200 at 1 M: (\d+) with `--prefill-chunk 64`, (\d+) with `--engram host`", README.read_text())
    assert (int(m.group(1)), int(m.group(2))) == (largest(h200["mesh"], 1048576, "H200", chunk=64),
                                                  largest(h200["mesh"], 1048576, "H200", engram="host"))


def test_plan_knows_the_devices_users_have(capsys):
    """`dsv41 plan --device` knows v5e (Colab and Kaggle's TPU, missing before), v5p, v6e, v7x, H100,
    H200 and B200, with the HBM the vendors state (sharding/devices.py cites them)."""
    from dsv41_jax.cli.main import main
    from sharding.devices import HBM_GIB

    assert HBM_GIB == {"v5e": 16, "v5p": 95, "v6e": 32, "v7x": 192, "H100": 80, "H200": 141, "B200": 180}
    for device, hbm in HBM_GIB.items():
        code = main(["plan", "--config", "tiny", "--mesh", "data=1", "--device", device, "--batch", "1",
                     "--context", "64", "--no-compile"])
        out = capsys.readouterr().out
        assert code == 0 and f"{device}: {hbm} GiB HBM" in out, out


SERVING = REPO / "docs" / "SERVING.md"


def test_serving_doc_plans_for_one_host():
    """docs/SERVING.md's `dsv41 plan` outputs for one host's devices (GPU host, TPU VM, Colab /
    Kaggle): every per-device line, the verdict and the largest batch, recomputed from the command
    printed above each block."""
    from sharding.plan import build_plan, max_batch

    blocks = re.findall(r"^\$ dsv41 plan --config v41-flash (.*?)\n(.*?)\n```", SERVING.read_text(), re.S | re.M)
    assert len(blocks) == 4, "the four `dsv41 plan` blocks of docs/SERVING.md changed shape"
    for cmd, out in blocks:
        a = dict(re.findall(r"--([\w-]+) (?!-)(\S+)", cmd))
        kw = dict(batch=int(a["batch"]), context=int(a["context"]), device=a["device"], engram=a.get("engram", "hbm"))
        d = build_plan(_cfg(), a["mesh"], **kw)
        for name, key in [("weights", "weights"), ("engram", "engram"), ("caches", "cache"),
                          ("activations", "activations"), ("total", "total")]:
            shown = float(re.search(rf"^  {name}\s+([\d.]+) GiB", out, re.M).group(1))
            assert shown == round(d["per_device_bytes"][key] / GiB, 2), (cmd, name, shown)
        assert ("-> fits" in out) == d["fits"], cmd
        biggest = int(re.search(r"^largest batch that fits \w+ at context \d+: (\d+)", out, re.M).group(1))
        assert biggest == max_batch(_cfg(), a["mesh"], context=kw["context"], device=a["device"], engram=kw["engram"]), cmd

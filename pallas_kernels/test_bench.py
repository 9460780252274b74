"""bench/kernels.py --quick runs on CPU and writes the JSON fields the performance docs rely on."""
import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert _load().main(["--quick", "--reps", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["roof_GBps"] > 0
    kernels = {e["kernel"] for e in report["results"]}
    assert kernels == {"sparse_attention", "indexer_scores", "grouped_fp4_gemm", "fp8_block_gemm"}
    for entry in report["results"]:
        assert entry["bytes"] > 0 and entry["xla"]["time_us"] > 0 and 0 < entry["xla"]["frac_roof"]
    assert "speedup" in capsys.readouterr().out  # the printed table's header

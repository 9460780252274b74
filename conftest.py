"""Test-session setup: 8 fake CPU devices for sharding tests, and the golden folder."""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib
import shutil
import tempfile

import pytest

# A persistent compilation cache shared by the xdist workers and the subprocesses tests start
# (CLI runs, notebook kernels): most of the suite's time is XLA compiling whole-model programs,
# and tests in different modules (or on the other worker) compile identical ones. The first
# process to import this file (the xdist controller, or the only process) makes a fresh folder
# and removes it at exit; workers inherit it through the environment, so every run starts
# empty, as on CI's clean clone. The key is a hash of the lowered program, the jax/jaxlib
# versions, the platform, XLA_FLAGS and the compile options (jax/_src/cache_key.py), and
# programs with host callbacks are never written, so a hit is the same executable the compile
# would have produced. DSV41_JAX_CACHE_DIR=<folder> keeps a cache across runs (same machine
# only: CPU executables are built for this host); DSV41_JAX_CACHE_DIR=off disables it.
_CACHE_SETTING = os.environ.get("DSV41_JAX_CACHE_DIR", "")
_OWN_CACHE_DIR = None
if _CACHE_SETTING != "off" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    if _CACHE_SETTING:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_SETTING
    else:
        _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="dsv41-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE_DIR
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    # every program, however fast it compiled (the defaults skip those under 1 s)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


# Under xdist (`-n 2`, .ci/run): whole test files are the work units, handed out longest first.
# xdist's default `--dist load` sends runs of consecutive tests, so a file's tests could land on
# both workers and each would build (compile) the file's module fixtures; and a long file handed out
# last leaves the other worker idle at the end. Files in one _SHARED_UNIT run on one worker, one
# after the other, sharing one compiled step (the tiny_fast_step fixture: test_model_pallas's impl="xla"
# prefill-13 and decode steps are test_model.py's fast programs). DSV41_XDIST_SCHEDULE=xdist
# leaves the scheduling to xdist.
_SHARED_UNIT = {"tests/model/test_model_pallas.py": "tests/model/test_model.py"}
# Worker-seconds per file on the 2-core CI box, rounded (setup + call + teardown per file from a clean-clone
# `.ci/run` with PYTEST_ADDOPTS=--durations=0, less what was then moved to -m slow); only the
# order matters, and files not listed go last in collection order.
_FILE_SECONDS = {
    "tests/sharding/test_sharding.py": 162, "tests/http/test_serve_mesh.py": 121, "tests/model/test_model.py": 109,
    "tests/golden/test_golden.py": 108, "tests/model/test_model_pallas.py": 88, "tests/train/test_train.py": 85,
    "tests/http/test_serve_images.py": 82, "pallas_kernels/expert_gemm/test_expert_gemm.py": 69,
    "tests/serving/test_serving.py": 66, "pallas_kernels/sparse_attention/test_sparse_attention.py": 64,
    "tests/model/test_stored_weights.py": 56, "pallas_kernels/indexer/test_indexer.py": 50, "tests/model/test_info.py": 47,
    "tests/http/test_serve_http.py": 45, "tests/project/test_notebooks.py": 45, "tests/numerics/test_sparse_attention.py": 43,
    "tests/serving/test_generate.py": 40, "tests/golden/test_golden_sweep.py": 35, "tests/numerics/test_quant.py": 32,
    "tests/checkpoint/test_checkpoint.py": 30, "tests/http/test_serve_echo.py": 29, "tests/numerics/test_gemm.py": 27,
    "tests/http/test_serve_warmup.py": 26, "tests/layers/test_mhc_sinkhorn.py": 26, "tests/numerics/test_host_dispatch.py": 23,
    "tests/http/test_serve_isolation.py": 19, "tests/train/test_train_kernels.py": 18, "tests/vision/test_vision_sources.py": 15,
    "tests/model/test_layer_body.py": 14, "pallas_kernels/test_bench.py": 13,
    # files the list above missed (they ran last, in collection order: the 78-s one at the tail), from the
    # clean-clone run of 2026-12-04 (909.2 s, --durations=0)
    "tests/golden/test_golden_wide.py": 78, "tests/model/test_layer_scan.py": 65, "tests/layers/test_moe_exact_paths.py": 12,
    "pallas_kernels/common/test_partition.py": 29,
    # its cross-process cell is two processes beside the oracle in the worker's own process (three at
    # once on 2 cores): 33 s alone (2026-12-05, fast numerics; 85 s in exact numerics in the clean-clone
    # run of 2026-12-04); listed high so that it starts early, not at the suite's tail
    "tests/serving/test_engine_multihost.py": 60,
    # measured alone on the loaded machine (not from a CI run): XLA:TPU and Mosaic compiles in child processes
    "tests/sharding/test_tpu_compile.py": 65, "pallas_kernels/test_mosaic_compile.py": 20,
}


def _xdist_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _SHARED_UNIT.get(path, path)


def _schedule_by_file() -> bool:
    return os.environ.get("DSV41_XDIST_SCHEDULE", "files") != "xdist"


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput") or not _schedule_by_file():
        return  # only the xdist workers' collections (identical on every worker: a stable sort)
    weight, seen = {}, set()
    for item in items:
        path, unit = item.nodeid.split("::", 1)[0], _xdist_unit(item.nodeid)
        weight[unit] = weight.get(unit, 0) + (0 if path in seen else _FILE_SECONDS.get(path, 0))
        seen.add(path)
    # heaviest unit first; the unit name keeps a unit's files together; unlisted files keep their order
    items.sort(key=lambda item: (-weight[_xdist_unit(item.nodeid)],
                                 _xdist_unit(item.nodeid) if weight[_xdist_unit(item.nodeid)] else ""))


class _FileUnits:
    """The xdist scheduler hook, registered only when xdist is loaded (its hook spec exists then)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") != "load" or not _schedule_by_file():
            return None  # an explicit --dist other than load is kept
        from xdist.scheduler import LoadScopeScheduling

        class FileScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                return _xdist_unit(nodeid)

        config.option.loadscopereorder = False  # keep the workers' longest-first order
        return FileScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FileUnits(), "dsv41-xdist-file-units")
    if _COMPILE_REPORT:
        _install_compile_listeners()


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)

REPO = pathlib.Path(__file__).resolve().parent


def golden_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DSV41_GOLDEN_DIR", REPO.parent / "shared" / "golden"))


@pytest.fixture(scope="session")
def golden_root() -> pathlib.Path:
    root = golden_dir()
    if not root.is_dir():
        pytest.skip(f"golden folder {root} not found; set DSV41_GOLDEN_DIR to run golden tests")
    return root


@pytest.fixture(scope="session")
def tiny_every_role():
    """(cfg, graphdef, params) of a tiny model with every layer role: SWA, Full r2, Reuse, Reindex r2,
    Full r1 + pool source, Reindex r1 in the pool, Reuse; a small window and few candidates make the
    window ring, pool and top-k all bind at short lengths."""
    from flax import nnx

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.model.transformer import Transformer

    cfg = ModelConfig.tiny(engram_layer_ids=(), window_size=4, index_topk=4, candidate_topk_blocks=2,
                           candidate_block_size=4, max_seq_len=32, max_batch_size=2)
    graphdef, params = nnx.split(Transformer(cfg, rngs=1))
    return cfg, graphdef, params


@pytest.fixture(scope="session")
def tiny_fast_step(tiny_every_role):
    """The fast-mode, impl="xla" jitted step of tiny_every_role, one per test process: test_model.py and
    test_model_pallas.py (its impl="xla" side) run the same (batch, length) programs through it, so each
    compiles once per worker (xdist runs the two files on one worker, see _SHARED_UNIT). Separate
    make_step calls did not share them through the persistent cache (measured: 2 hits)."""
    from dsv41_jax.model.transformer import make_step
    from dsv41_jax.runtime import Runtime

    return make_step(tiny_every_role[1], Runtime(mode="fast", impl="xla"))


# DSV41_COMPILE_REPORT=N: after the run, the N test phases that spent the most time in XLA
# compilation, with their tracing/lowering time and persistent-cache hits (works under xdist:
# the figures travel in each report's user_properties). For finding where the suite's time goes.
_COMPILE_REPORT = int(os.environ.get("DSV41_COMPILE_REPORT", "0") or 0)
_jax_times = {"compile": 0.0, "trace": 0.0, "lower": 0.0, "hits": 0}
_compile_rows = []


def _install_compile_listeners():
    from jax._src import monitoring

    names = {"/jax/core/compile/backend_compile_duration": "compile",
             "/jax/core/compile/jaxpr_trace_duration": "trace",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}

    def on_duration(event, duration, **_):
        if event in names:
            _jax_times[names[event]] += duration

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _jax_times["hits"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)


if _COMPILE_REPORT:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        item.user_properties[:] = [p for p in item.user_properties if p[0] != "jax_times"]
        item.user_properties.append(("jax_times", dict(_jax_times)))
        for k in _jax_times:
            _jax_times[k] = 0 if k == "hits" else 0.0
        yield

    def pytest_runtest_logreport(report):
        times = dict(report.user_properties).get("jax_times")
        if times is not None:
            _compile_rows.append((times["compile"], report.duration, report.when, report.nodeid, times))

    def pytest_terminal_summary(terminalreporter):
        rows = sorted(_compile_rows, reverse=True)[:_COMPILE_REPORT]
        tr = terminalreporter
        tr.section(f"top {len(rows)} test phases by XLA compile time")
        total = sum(r[0] for r in _compile_rows)
        tr.write_line(f"all phases: {total:.1f} s compiling, {sum(r[4]['trace'] + r[4]['lower'] for r in _compile_rows):.1f} s "
                      f"tracing+lowering, {sum(r[1] for r in _compile_rows):.1f} s in all, "
                      f"{sum(r[4]['hits'] for r in _compile_rows)} persistent-cache hits")
        for comp, dur, when, nodeid, t in rows:
            tr.write_line(f"{dur:7.1f}s {when:8s} compile {comp:6.1f}s trace+lower {t['trace'] + t['lower']:5.1f}s "
                          f"hits {t['hits']:3d}  {nodeid}")

"""Assemble a server from a model and a tokenizer, and run it with uvicorn.

`build` wires Engine -> EngineWorker -> FastAPI app; `BackgroundServer` runs the real uvicorn
server in a thread on 127.0.0.1 (for tests, benches and notebooks); `dsv41 serve` calls `serve`.
"""
from __future__ import annotations

import dataclasses
import socket
import threading
import time

from dsv41_jax.serving.engine import Engine, EngineSettings
from dsv41_jax.serving.generate import banned_ids as banned, engram_tables
from dsv41_jax.serving.http.app import build_app, ServerConfig
from dsv41_jax.serving.http.metrics import Metrics
from dsv41_jax.serving.http.worker import EngineWorker
from sharding.serving import engine_strategies


@dataclasses.dataclass
class ServeOptions:
    """The server knobs of `dsv41 serve` (see its --help), and the settings of the engine it serves with."""

    model_name: str = "dsv41"
    # slots = --max-batch, max_seq_len = --max-model-len (None: the config's), speculative = K DSpark
    # drafts per step (needs exact_prefill); `make_engine` adds the tokenizer's banned ids
    engine: EngineSettings = EngineSettings()
    max_queue: int = 256
    api_key: str | None = None
    cache_dir: str | None = None
    cache_bytes: int = 1 << 30
    max_request_bytes: int = 32 << 20
    warm: bool = False  # compile every program before /ready says ready (`dsv41 serve` turns it on)
    mesh: object = None  # a jax.sharding.Mesh to serve on (sharding.serving.engine_strategies); None = one device
    preset: str = "inference"  # its sharding preset (the vocabulary of `dsv41 plan`)
    engram_host: bool = False  # Engram tables in host memory (sharding.serving.engine_strategies, --engram host)
    test_hooks: bool = False  # tests build the app with this; no `dsv41 serve` flag sets it
    images: object = None  # images.ImageOptions (limits); None = the defaults
    effort_table: object = None  # reasoning_effort names -> budgets (chat.EFFORT_TABLES); None: the default
    # across processes, on process 0: (lockstep.Channel, lockstep.Watchdog); its engine publishes every call
    lockstep: object = None

    @property
    def max_batch(self) -> int:
        """Sequences served together (the engine's slots), by the server's name."""
        return self.engine.slots

    @property
    def max_model_len(self) -> int | None:
        """Prompt + completion limit per sequence (the engine's max_seq_len), by the server's name."""
        return self.engine.max_seq_len


def banned_ids(cfg, tokenizer) -> list[int]:
    """`serving.generate.banned_ids`: what the server never samples (`dsv41 generate` bans the same)."""
    return banned(cfg, tokenizer)


def make_engine(model, tokenizer, opts: ServeOptions) -> Engine:
    """The engine `build` serves with (every process serving across processes builds the same one).
    Its `max_seq_len` is the server's max model length (`EngineSettings.for_model`: the options' or the
    config's); the smallest capacity bucket is at most that."""
    cfg = model.cfg
    settings = opts.engine.for_model(cfg)
    settings = dataclasses.replace(settings, min_capacity=min(settings.min_capacity, settings.max_seq_len),
                                   banned_ids=tuple(banned_ids(cfg, tokenizer)))
    engram = engram_tables(cfg, tokenizer) if cfg.engram_layer_ids else None
    return Engine(model, settings, engram=engram, **engine_strategies(opts.mesh, opts.preset, opts.engram_host))


def build(model, tokenizer, opts: ServeOptions):
    """(FastAPI app, EngineWorker) for a loaded model; the worker thread is not started."""
    cfg = model.cfg
    engine = make_engine(model, tokenizer, opts)
    max_len = engine.max_seq_len
    processes = None
    if opts.lockstep is not None:  # process 0 of several: publish every engine call (serving/lockstep.py)
        from dsv41_jax.serving.lockstep import LeaderEngine  # deferred: serving across processes only

        channel, watchdog = opts.lockstep
        engine = LeaderEngine(engine, channel, watchdog)
        processes = watchdog.status
    metrics = Metrics(opts.max_batch)
    if engine.K:
        metrics.watch_speculation(engine)
    conversations = None
    if opts.cache_dir is not None:
        from dsv41_jax.serving.http.conversations import ConversationStore  # deferred: with a cache dir only

        conversations = ConversationStore(opts.cache_dir, opts.cache_bytes, engine, metrics)
    warm = None
    if opts.warm:
        from dsv41_jax.serving import warmup  # deferred: when warming only

        replay = conversations is not None

        def warm(engine, progress):  # across processes every process warms its own engine, unpublished
            return warmup.warm(getattr(engine, "local", engine), replay=replay, echo=True, progress=progress)
    worker = EngineWorker(engine, metrics, max_queue=opts.max_queue, warm=warm)
    metrics.watch_compiles(worker)
    has_vision = bool(getattr(cfg, "vision_enabled", False))
    images = None
    if has_vision:
        # deferred: the image path (PIL, the tower's encoder) loads for a model with a vision tower only
        from dsv41_jax.serving.http.images import ImageOptions, ImagePrompter

        images = ImagePrompter(engine, opts.images or ImageOptions())
    scfg = ServerConfig(opts.model_name, max_len, api_key=opts.api_key, test_hooks=opts.test_hooks,
                        conversations=conversations, has_vision=has_vision, images=images,
                        max_request_bytes=opts.max_request_bytes, effort_table=opts.effort_table,
                        processes=processes)
    app = build_app(worker, tokenizer, scfg)
    app.state.conversations = conversations
    return app, worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The real uvicorn server in a daemon thread, plus the engine thread; `close()` stops both."""

    def __init__(self, app, worker: EngineWorker, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.app, self.worker, self.host, self.port = app, worker, host, port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, name="dsv41-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.worker.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.worker.stop()


def serve(app, worker: EngineWorker, host: str, port: int):
    """Run in the foreground until interrupted."""
    import uvicorn

    worker.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        worker.stop()

"""`dsv41 serve`: an OpenAI-compatible HTTP server on the continuous-batching engine (docs/SERVING.md).

Cheap checks first (folder, tokenizer.json, options), so a bad input fails with exit code 2
before any weights are read. Then the checkpoint is loaded, the engine thread started and
uvicorn serves until interrupted. SIGTERM or SIGINT while the warm-up compiles ends the process
at once with exit code 0 (a compile cannot be interrupted, and uvicorn would wait for it): after
the compilation-cache entry being written, if any, is complete (`warmup.quiesce_cache`).
`--warm-only` compiles every program into the persistent compilation cache and exits.

Across processes (`--coordinator HOST:PORT --num-processes N --process-id I`, or a TPU pod slice /
SLURM job detected by JAX; docs/SERVING.md "Across hosts"): every process runs the same command,
joins JAX's distributed runtime first, and loads its own shards of the checkpoint onto a mesh over
every process's devices. Process 0 serves HTTP and publishes each engine call
(`serving.lockstep.LeaderEngine`); the others warm up the same way, then make the same calls
(`serving.lockstep.follow`) and serve nothing. A watchdog (`--process-timeout`) ends every process
when one stops answering.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import signal
import sys
import time

from collections.abc import Callable

from dsv41_jax.cli import distributed, speculative
from dsv41_jax.cli.argtypes import effort_table, positive_int
from dsv41_jax.cli.model_args import InputError, add_mesh_args, load_on, mesh_of


def _byte_size(text: str) -> int:
    """A positive byte count: 1073741824, 4G, 500M, 64KiB (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a byte count such as 4G or 500M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive byte count such as 4G or 500M, got {text!r}")
    return value


def _port(text: str) -> int:
    """A TCP port, 1-65535 (the kernel would silently wrap a larger number)."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {value}")
    return value


def load_server(args, lockstep=None, follower: bool = False):
    """(app, worker, options) for the parsed arguments; raises InputError on bad input.
    lockstep: process 0's (Channel, Watchdog) across processes. follower: a process other than 0
    across processes: (tokenizer, engine, options), the engine warmed up (when the server warms)."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.checkpoint import checkpoint_format
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving import warmup
    from dsv41_jax.serving.http.images import image_options
    from dsv41_jax.serving.engine import EngineSettings
    from dsv41_jax.serving.http.server import ServeOptions, build
    from dsv41_jax.text.tokenizer import load_tokenizer

    speculative.check_flags(args)
    folder = pathlib.Path(args.checkpoint)
    if not folder.is_dir():
        raise InputError(f"--checkpoint {folder}: no such folder")
    if not (folder / "tokenizer.json").is_file():
        raise InputError(f"--checkpoint {folder}: no tokenizer.json; copy the tokenizer.json that ships with the "
                         "weights into it (checkpoints from `dsv41 train --export` and `dsv41 demo` carry one)")
    checkpoint_format(folder)
    speculative.check_checkpoint(args, folder)
    tokenizer = load_tokenizer(folder)
    # before anything compiles: JAX decides once, at its first compile, whether a cache is on
    cache = warmup.compile_cache(warmup.default_cache_dir() if args.compile_cache is None else args.compile_cache)
    if cache is not None and not args.quiet:
        print(f"dsv41 serve: compilation cache {cache} (--compile-cache off to disable)", file=sys.stderr)
    overrides = {"max_batch_size": args.max_batch}
    if args.max_model_len is not None:
        overrides["max_seq_len"] = args.max_model_len
    if args.numerics == "exact":
        import jax

        jax.config.update("jax_enable_x64", True)
    mesh = mesh_of(args)
    cfg, model, report = load_on(folder, mesh, args.preset, args.engram, progress=not args.quiet,
                                 config_overrides=overrides)
    if not args.quiet:
        print(report.summary(), file=sys.stderr)
    if mesh is not None and not args.quiet and jax_processes() > 1:
        print(f"dsv41 serve: mesh {dict(mesh.shape)} over {mesh.devices.size} devices of {jax_processes()} processes "
              "(each loads its own shards)", file=sys.stderr)
    k = speculative.draft_tokens(args, model)
    # the config holds --max-model-len (a load override), so the engine's length is the config's
    engine = EngineSettings(slots=args.max_batch, max_seq_len=cfg.max_seq_len, prefill_chunk=args.prefill_chunk,
                            exact_prefill=args.exact_prefill, runtime=Runtime(mode=args.numerics, impl=args.impl),
                            speculative=k, spec_acceptance=speculative.acceptance(args))
    opts = ServeOptions(model_name=args.served_model_name or folder.resolve().name, engine=engine,
                        max_queue=args.max_queue, api_key=args.api_key, cache_dir=args.prefix_cache_dir,
                        cache_bytes=args.prefix_cache_bytes, max_request_bytes=args.max_request_bytes,
                        warm=not args.no_warm, mesh=mesh, preset=args.preset, engram_host=args.engram == "host",
                        images=image_options(args), effort_table=args.effort_table, lockstep=lockstep)
    if follower:
        # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
        from dsv41_jax.serving.http.server import make_engine

        engine = make_engine(model, tokenizer, opts)
        if opts.warm:  # the same programs in the same order as process 0's warm-up: their collectives pair up
            try:
                warmup.warm(engine, replay=opts.cache_dir is not None, echo=True)
            except Exception:  # noqa: BLE001 - as process 0's worker does: go on cold (its reset follows)
                import traceback

                traceback.print_exc()
                engine.reset()
        return tokenizer, engine, opts
    app, worker = build(model, tokenizer, opts)
    if not args.quiet:
        worker.warm_progress = _print_warm_progress
    return app, worker, opts


def _print_warm_progress(done: int, total: int, name: str, seconds: float) -> None:
    if done == 0:
        print(f"dsv41 serve: warming up: compiling {total} programs (GET /ready answers 503 until done; "
              "requests sent meanwhile wait)", file=sys.stderr, flush=True)
        return
    print(f"dsv41 serve: warm-up {done}/{total}: {name} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    if done == total:
        print("dsv41 serve: ready", file=sys.stderr, flush=True)


def jax_processes() -> int:
    import jax

    return jax.process_count()


def _cmd_serve(args) -> int:
    code = distributed.join(args, "dsv41 serve")
    if code is not None:
        return code
    if jax_processes() > 1:
        return _serve_across(args)
    try:
        _check_warm_only(args)
        app, worker, opts = load_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv41 serve: {e}", file=sys.stderr)
        return 2
    if args.warm_only:
        return warm_only(worker, "dsv41 serve")
    info = {"url": f"http://{args.host}:{args.port}", "model": opts.model_name, "max_model_len": opts.max_model_len,
            "max_batch": opts.max_batch}
    print(json.dumps(info) if args.json else f"dsv41 serve: {opts.model_name} on {info['url']} "
          f"(max batch {opts.max_batch}, max model length {opts.max_model_len})", file=sys.stderr)
    serve(app, worker, args.host, args.port)
    return 0


def _check_warm_only(args) -> None:
    if not args.warm_only:
        return
    if args.no_warm:
        raise InputError("--warm-only and --no-warm: --warm-only compiles every program and exits; drop one")
    if args.compile_cache is not None and str(args.compile_cache) == "off":
        raise InputError("--warm-only --compile-cache off: --warm-only fills the persistent compilation cache; "
                         "give it a folder (or leave --compile-cache out for the default)")


def stop_while_warming(worker, name: str) -> Callable[[int, object], None]:
    """A signal handler: during the warm-up, exit 0 at once (once the compilation cache holds no
    half-written entry); after it, nothing (uvicorn, which re-raises the signal it handled to the
    handler it replaced, has shut the server down by then)."""
    def handler(sig, frame):
        if worker.ready.is_set():
            return
        # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
        from dsv41_jax.serving import warmup

        st = worker.warm_state
        print(f"{name}: {signal.Signals(sig).name} during the warm-up ({st['done']}/{st['total']} programs "
              "compiled): exiting", file=sys.stderr, flush=True)
        if not warmup.quiesce_cache():
            print(f"{name}: the compilation cache's lock was not free within 60 s; exiting anyway",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return handler


def serve(app, worker, host: str, port: int) -> None:
    """uvicorn in the foreground until interrupted, the engine thread beside it; a signal during the
    warm-up ends the process at once (`stop_while_warming`)."""
    import uvicorn

    stop = stop_while_warming(worker, "dsv41 serve")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            stop(sig, frame)
            super().handle_exit(sig, frame)

    worker.start()
    try:
        Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
    finally:
        worker.stop()


def warm_only(worker, name: str) -> int:
    """Compile every program (into the persistent compilation cache) and exit: 0, or 1 when the
    warm-up failed. The main thread waits, so a signal is handled at once."""
    import jax

    stop_while_warming(worker, name)
    worker.start()
    while not worker.ready.wait(0.2):
        pass
    st = worker.readiness()
    worker.stop()
    if st["error"] is not None:
        print(f"{name}: the warm-up failed: {st['error']}", file=sys.stderr, flush=True)
        return 1
    print(f"{name}: compiled {st['total']} programs in {st['seconds']:.1f} s into the compilation cache "
          f"{jax.config.jax_compilation_cache_dir}; exiting (--warm-only)", file=sys.stderr, flush=True)
    return 0


FLUSH_S = 1.0  # process 0, after a process died: time for uvicorn to send the error answers before exiting


def _serve_across(args) -> int:
    """One of several processes: process 0 serves HTTP (its engine publishes every call), the others
    follow. Every exit is os._exit: jax.distributed.shutdown's barrier would wait for a dead process."""
    import jax

    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.serving.constraints import Grammars
    from dsv41_jax.serving.lockstep import Channel, Watchdog, follow

    me, n = jax.process_index(), jax.process_count()
    name = f"dsv41 serve (process {me} of {n})"
    holder = {}

    def on_dead(ids):
        if me != 0:
            print(f"{name}: process 0 is gone (its coordination service stopped answering); exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)
        msg = (f"process {', '.join(map(str, ids))} of {n} stopped answering (no heartbeat for "
               f"{args.process_timeout:g} s); serving across processes cannot go on, so this server exits")
        print(f"{name}: {msg}", file=sys.stderr, flush=True)
        worker = holder.get("worker")
        if worker is not None:
            answered = worker.fail_open(503, msg)
            print(f"{name}: answered {answered} open request(s) with HTTP 503", file=sys.stderr, flush=True)
            time.sleep(FLUSH_S)
        os._exit(1)

    channel = Channel()
    watchdog = Watchdog(on_dead, timeout=args.process_timeout, interval=min(0.5, args.process_timeout / 4)).start()
    try:
        _check_warm_only(args)
        app, worker, opts = load_server(args, lockstep=(channel, watchdog) if me == 0 else None, follower=me != 0)
    except (ValueError, FileNotFoundError) as e:
        # every process reads the same folder and flags, so each refuses them alike
        print(f"{name}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    if args.warm_only:  # every process compiled its own programs (the followers inside load_server)
        code = warm_only(worker, name) if me == 0 else 0
        sys.stderr.flush()
        os._exit(code)
    if me != 0:
        print(f"{name}: following process 0 (this process serves nothing)", file=sys.stderr, flush=True)
        tokenizer, engine = app, worker  # what load_server gives a follower
        grammars = functools.cache(functools.partial(Grammars, tokenizer, engine.cfg.vocab_size))
        try:
            code = follow(engine, channel, grammars=grammars)
        except Exception as e:  # noqa: BLE001 - the channel failed: process 0 (the coordination service) is gone
            print(f"{name}: lost process 0: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            code = 1
        sys.stderr.flush()
        os._exit(code)
    holder["worker"] = worker
    info = {"url": f"http://{args.host}:{args.port}", "model": opts.model_name, "max_model_len": opts.max_model_len,
            "max_batch": opts.max_batch, "processes": n}
    print(json.dumps(info) if args.json else f"{name}: {opts.model_name} on {info['url']} (max batch {opts.max_batch}, "
          f"max model length {opts.max_model_len}, {n} processes)", file=sys.stderr, flush=True)
    code = 0
    try:
        serve(app, worker, args.host, args.port)
    except BaseException:  # noqa: BLE001 - the followers still stop
        code = 1
    finally:
        channel.publish(("stop",))
        channel.drained(timeout=30)  # the followers read it before the coordination service goes
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 1..3600 seconds, got {text!r}")
    return value


def register(subparsers) -> None:
    s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, models)",
                              description="Serve a checkpoint over an OpenAI-compatible HTTP API "
                                          "(docs/SERVING.md). Bad inputs exit with code 2.")
    s.add_argument("--checkpoint", required=True, metavar="DIR", help="HF or orbax checkpoint folder with tokenizer.json")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000, help="port, 1-65535 (default 8000)")
    s.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the folder name)")
    s.add_argument("--max-batch", type=positive_int, default=4, help="concurrent sequences (engine slots, default 4)")
    s.add_argument("--max-model-len", type=positive_int, default=None, help="prompt + completion limit (default: the config's)")
    s.add_argument("--max-queue", type=positive_int, default=256, help="waiting requests before 429 (default 256)")
    s.add_argument("--prefill-chunk", type=positive_int, default=512, help="prefill chunk length (default 512)")
    s.add_argument("--exact-prefill", action="store_true", help="prefill every layer over every token (no CED split)")
    add_mesh_args(s)
    s.add_argument("--numerics", choices=("fast", "exact"), default="fast", help="fp32 accumulation (fast) or float64 (exact)")
    s.add_argument("--impl", choices=("xla", "pallas", "auto"), default="xla", help="attention/MoE implementation")
    s.add_argument("--prefix-cache-dir", metavar="DIR", help="keep conversation caches in this folder")
    s.add_argument("--prefix-cache-bytes", type=_byte_size, default=1 << 30,
                   help="byte budget of the conversation caches, LRU-evicted (default 1G)")
    s.add_argument("--effort-table", type=effort_table, default=None, metavar="NAME|name=N,...",
                   help="what reasoning_effort names mean: deepseek-api (low/high/max = 50/75/100, the default) or "
                        "v41-encoder (low/high/xhigh/max = 25/50/75/100, as vLLM's and SGLang's V4.1 encoders), "
                        "or pairs like low=25,high=50,max=100 (must name 'high')")
    s.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--max-request-bytes", type=_byte_size, default=32 << 20,
                   help="largest request body; a larger one gets HTTP 413 before it is read (default 32M)")
    s.add_argument("--no-warm", action="store_true",
                   help="skip the warm-up: report ready at once and compile each program on first use "
                        "(the first requests then wait for compiles)")
    s.add_argument("--warm-only", action="store_true",
                   help="compile every program into the persistent compilation cache and exit 0 (1 when the "
                        "warm-up fails), serving nothing: fill the cache before traffic (README 'Compilation cache')")
    s.add_argument("--compile-cache", metavar="DIR|off", default=None,
                   help="persistent compilation cache folder, so a restart loads programs instead of compiling "
                        "(default: $DSV41_COMPILE_CACHE, $JAX_COMPILATION_CACHE_DIR or ~/.cache/dsv41-jax/xla; 'off' disables it)")
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.serving.http.images import add_image_args

    add_image_args(s)
    speculative.add_args(s)
    distributed.add_arguments(s)
    s.add_argument("--process-timeout", type=_seconds, default=10.0, metavar="S",
                   help="across processes: a process whose heartbeat stops for S seconds ends serving: process 0 "
                        "answers its open requests with HTTP 503 naming it and exits 1 within about S + 2 s "
                        "(default 10; below JAX's own 100 s heartbeat timeout)")
    s.add_argument("--json", action="store_true", help="print the start-up line as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress bar or load summary on stderr")
    s.set_defaults(func=_cmd_serve)

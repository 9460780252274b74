"""The engine thread: the only thread that touches the `Engine`.

HTTP handlers run on the asyncio event loop and never call the engine; they hand a `Job` to
`EngineWorker.submit` and read its events from an asyncio queue. The thread takes submissions
and cancellations from a thread-safe inbox between engine steps (so a client that went away
frees its slot at the next step), runs `Engine.step`, and posts each token and the final result
back to the job's event loop with `call_soon_threadsafe`. A request that fails on its own (its
prefill, its stored conversation, its token callback) gets a 500 and the others go on; a batch
step that raises fails the requests it held (HTTP 500) and the engine is reset; the thread keeps
serving.

With `warm` (serving/warmup.py) the thread first compiles every program the engine will run;
requests submitted meanwhile wait in the inbox, and `readiness()` (the server's /ready) reports
the progress until it is done. `compiles_after_ready()` counts the programs the thread compiled
(or loaded from the persistent cache) after that: a complete warm-up leaves it at 0.

Test hook: with the environment variable `DSV41_TEST_HOLD_FULL_BATCH=PATH`, the thread, before a step
with every batch slot busy and a request waiting for one, waits while the file PATH exists (having
created PATH.held): a test holds those requests open while it kills a process, so none can finish
first (no race).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import pathlib
import queue
import sys
import threading
import time
import traceback

from dsv41_jax.serving import warmup
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.http.metrics import Metrics
from dsv41_jax.serving.http.protocol import APIError


@dataclasses.dataclass
class Job:
    """One request on its way through the engine thread. `events` receives
    ("token", id, logprobs), then ("done", Result) or ("error", status, message)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    last_token: float | None = None
    fail_in_engine: int = 0  # tests: raise inside the engine while emitting token k (1 = at admission)
    emitted: int = 0
    on_finish: object = None  # called in the engine thread with the Result (conversation caches)
    on_admit: object = None  # called in the engine thread before submit (may set resume_from)
    on_cancel: object = None  # called in the engine thread when the request is dropped


class QueueFull(Exception):
    pass


HOLD_ENV = "DSV41_TEST_HOLD_FULL_BATCH"  # tests only (module doc)


class EngineWorker:
    """Runs `engine` in a daemon thread; `max_queue` bounds the requests not yet in a slot."""

    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int = 256, warm=None):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.warm = warm  # callable(engine, progress) -> dict, run in the engine thread before serving
        self.ready = threading.Event()
        self._compiles_at_ready: int | None = None  # the engine thread's compile count when ready
        self.warm_state = {"done": 0, "total": 0, "current": None, "error": None, "seconds": None}
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[str, Job] = {}
        self._ids = itertools.count()
        self._pending = 0  # submitted but not yet taken from the inbox
        self._calling = None  # (loop, future) of the `call` the engine thread is running
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=30)

    # ------------------------------------------------------------------ event-loop side
    def depth(self) -> int:
        """Requests waiting for a slot (inbox plus the engine's queue)."""
        return self._pending + self.engine.occupancy()[1]

    def submit(self, job: Job) -> str:
        return self.submit_all([job])[0]

    def submit_all(self, jobs: list[Job]) -> list[str]:
        """Submit the choices of one request together: the queue bound admits or refuses them as one."""
        with self._lock:
            if self.depth() >= self.max_queue:
                raise QueueFull(f"the queue holds {self.depth()} requests (max {self.max_queue})")
            self._pending += len(jobs)
        for job in jobs:
            job.request.request_id = job.request.request_id or f"r{next(self._ids)}"
            self.inbox.put(("submit", job))
        return [job.request.request_id for job in jobs]

    def cancel(self, request_id: str, reason: str):
        """Drop a request at the next step (its slot is freed); `reason` labels
        `dsv41_cancelled_requests_total` when the request was still running or waiting."""
        self.inbox.put(("cancel", request_id, reason))

    def fail_open(self, status: int, message: str) -> int:
        """Answer every open request (in a slot, queued, or not yet taken from the inbox) with an
        error, from any thread (the serving-across-processes watchdog: the engine thread may be stuck
        in a collective whose peer is gone). Returns how many were answered."""
        jobs = list(self.jobs.values())
        calling = self._calling  # one running (echo's scoring pass), stuck in a collective
        calls = [calling] if calling is not None else []
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "submit":
                jobs.append(item[1])
            elif item[0] == "call":
                calls.append(item[2:])
        for loop, future in calls:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(APIError(status, message)))
        for job in jobs:
            self._post(job, ("error", status, message))
        return len(jobs)

    async def call(self, fn):
        """`fn(engine)` run in the engine thread between steps (e.g. scoring a prompt); its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.inbox.put(("call", fn, loop, future))
        return await future

    # ------------------------------------------------------------------ engine thread
    def _post(self, job: Job, event: tuple):
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def _on_token(self, job: Job):
        def emit(token: int, logprobs):
            job.emitted += 1
            if job.fail_in_engine and job.emitted >= job.fail_in_engine:
                raise RuntimeError(f"test fault injected inside the engine at token {job.emitted}")
            now = time.perf_counter()
            if job.last_token is None:
                self.metrics.ttft.observe(now - job.submitted)
            else:
                self.metrics.itl.observe(now - job.last_token)
            job.last_token = now
            self.metrics.generation_tokens.inc()
            self._post(job, ("token", token, logprobs))
        return emit

    def _take(self, block: bool):
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return False
        if item[0] == "submit":
            job = item[1]
            with self._lock:
                self._pending -= 1
            try:
                if job.on_admit is not None:
                    job.on_admit(job)
                job.request.on_token = self._on_token(job)
                self.engine.submit(job.request)
            except ValueError as e:
                self._post(job, ("error", 400, str(e)))
            except Exception as e:  # noqa: BLE001 - any failure is this request's 500
                traceback.print_exc()
                self._post(job, ("error", 500, f"internal error: {type(e).__name__}: {e}"))
            else:
                self.jobs[job.request.request_id] = job
                self.metrics.prompt_tokens.inc(len(job.request.prompt))
        elif item[0] == "call":
            _, fn, loop, future = item

            def settle(method, value):  # the awaiting handler may have gone away (client disconnect)
                if not future.done():
                    method(value)

            self._calling = (loop, future)
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller's failure, raised in the caller
                loop.call_soon_threadsafe(settle, future.set_exception, e)
            else:
                loop.call_soon_threadsafe(settle, future.set_result, result)
            finally:
                self._calling = None
        elif item[0] == "cancel":
            job = self.jobs.pop(item[1], None)
            if job is not None:
                self.engine.cancel(item[1])
                self.metrics.cancelled.labels(item[2]).inc()
                if job.on_cancel is not None:
                    job.on_cancel(job)
        return True

    def _gauges(self):
        running, waiting = self.engine.occupancy()
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting + self._pending)
        self.metrics.occupancy.set(running / self.engine.slots)

    def readiness(self) -> dict:
        """{"status": "ready" | "warming" | "warm-up failed" | "engine thread stopped", ...progress}."""
        st = dict(self.warm_state)
        if not self.thread.is_alive():
            status = "engine thread stopped"
        elif st["error"] is not None:
            status = "warm-up failed"
        else:
            status = "ready" if self.ready.is_set() else "warming"
        return {"status": status, **st}

    def _warm(self):
        def progress(done, total, name, seconds):
            self.warm_state.update(done=done, total=total, current=name)
            if self.warm_progress is not None:
                self.warm_progress(done, total, name, seconds)

        try:
            report = self.warm(self.engine, progress)
            self.warm_state["seconds"] = report.get("seconds")
        except Exception as e:  # noqa: BLE001 - a failed warm-up leaves a cold but working server
            traceback.print_exc()
            self.warm_state["error"] = f"{type(e).__name__}: {e}"
            self.engine.reset()

    warm_progress = None  # optional callable(done, total, name, seconds): `dsv41 serve` prints it

    def compiles_after_ready(self) -> int:
        """Programs the engine thread compiled or loaded since it became ready (0 before)."""
        if self._compiles_at_ready is None:
            return 0
        return warmup.compiles(self.thread.ident) - self._compiles_at_ready

    def _hold(self):
        """The test hook of the module doc (`HOLD_ENV`): nothing unless it is set and the file exists."""
        path = os.environ.get(HOLD_ENV)
        full = all(st is not None for st in self.engine.table) and bool(self.engine.waiting)
        if not path or not full or not os.path.exists(path):
            return
        pathlib.Path(path + ".held").touch()
        while os.path.exists(path) and not self._stop.is_set():
            time.sleep(0.05)

    def _run(self):
        warmup.count_compiles()
        if self.warm is not None:
            self._warm()
        self._compiles_at_ready = warmup.compiles()
        self.ready.set()
        while not self._stop.is_set():
            idle = self.engine.idle()
            if self._take(block=idle):
                while self._take(block=False):
                    pass
            self._gauges()
            if self.engine.idle():
                continue
            self._hold()
            try:
                finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the step's requests fail, the server stays up
                traceback.print_exc()
                self.metrics.engine_errors.inc()
                self.engine.reset()  # every request the engine held is gone, including one being admitted
                for job in self.jobs.values():
                    self._post(job, ("error", 500, f"internal error in the engine step: {type(e).__name__}: {e}"))
                self.jobs.clear()
                continue
            for result in finished:
                job = self.jobs.pop(result.request_id, None)
                self.engine.done.pop(result.request_id, None)
                if job is None:
                    continue
                if result.finish_reason == "error":  # this request failed alone; the others go on
                    print(f"dsv41 serve: request {result.request_id} failed: {result.error}", file=sys.stderr)
                    self.metrics.engine_errors.inc()
                    self._post(job, ("error", 500, f"internal error: {result.error}"))
                    continue
                if job.on_finish is not None:
                    try:
                        job.on_finish(job, result)
                    except Exception:  # noqa: BLE001 - a cache write never fails the request
                        traceback.print_exc()
                self._post(job, ("done", result))
            self._gauges()

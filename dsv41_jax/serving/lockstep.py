"""Process 0's host decisions, in order, on every process; and a watchdog for a process that dies.

Serving across processes (`dsv41 serve --coordinator ...`, docs/SERVING.md "Across hosts"):
process 0 owns HTTP and the scheduler, and every engine call it makes (a submit with its sampling
seed fixed, a cancel, a step, a reset, a conversation-cache prefill) must reach the other
processes before the step's collectives run, so that they run the same jitted programs on their
shards. `LeaderEngine` is the engine process 0's worker drives (it publishes each call, then makes
it); `follow` is the other processes' loop (it makes the same calls, and serves nothing). Every
request feature runs so: echo's scoring pass and the vision tower are engine calls too, and a
constrained request's grammar travels as its text, each process advancing its own matcher.

`Channel` carries those commands through the coordination service's key-value store (the one
`jax.distributed.initialize` starts on process 0): command n is the pickled object under
`{prefix}/cmd/{n}`; a follower blocks on the next key. Each follower acknowledges what it took,
and the leader deletes commands every follower has acknowledged, so the store holds only the
commands in flight.

`Watchdog` bounds how long a dead process goes unnoticed: every process bumps its own heartbeat
counter every `interval` seconds from a thread of its own (it keeps beating while the main thread
waits in a collective or a compile), and process 0 calls `on_dead(process_ids)` once some
counter has not moved for `timeout` seconds. That bound is meant to be well below JAX's own
heartbeat timeout (`jax.distributed.initialize(heartbeat_timeout_seconds=100)` by default), after
which the runtime may end every process without a word; the watchdog fires first, so process 0
can answer its open requests with an error naming the process and exit non-zero.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import sys
import threading
import time
import traceback
from dsv41_jax.serving import prefix_cache

CHUNK = 1 << 20  # a command's pickle larger than this goes into the store in parts (a conversation's cache)


def _client():
    from jax._src import distributed  # the coordination service client (no public accessor in jax 0.10)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: join it first (dsv41_jax.cli.distributed.join)")
    return client


class Channel:
    """Ordered commands from process 0 (`publish`) to every other process (`receive`)."""

    def __init__(self, prefix: str = "dsv41/lockstep"):
        import jax

        self.prefix, self.client = prefix, _client()
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.sent = 0  # leader: next command number
        self.taken = 0  # follower: next command number to receive
        self._deleted = 0  # leader: commands below this are gone from the store
        self._parts: dict[int, int] = {}  # leader: command number -> how many parts it was stored in

    def publish(self, command) -> int:
        """Leader only: append `command` (picklable; no callables); returns its number."""
        if self.process != 0:
            raise RuntimeError(f"only process 0 publishes commands; this is process {self.process}")
        n = self.sent
        data = pickle.dumps(command)
        parts = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] if len(data) > CHUNK else []
        for i, part in enumerate(parts):  # the parts first: a follower reads them once it sees the head
            self.client.key_value_set_bytes(f"{self.prefix}/cmd/{n}/{i}", part)
        if parts:
            self._parts[n] = len(parts)
        head = pickle.dumps(("__parts__", len(parts))) if parts else data
        self.client.key_value_set_bytes(f"{self.prefix}/cmd/{n}", head)
        self.sent += 1
        self._collect()
        return n

    def receive(self, timeout: float):
        """Follower: the next command, waiting up to `timeout` seconds (TimeoutError after)."""
        key = f"{self.prefix}/cmd/{self.taken}"
        try:
            data = self.client.blocking_key_value_get_bytes(key, max(1, int(timeout * 1000)))
        except Exception as e:  # noqa: BLE001 (the client raises XlaRuntimeError for a deadline, with the key)
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                raise TimeoutError(f"no command {self.taken} from process 0 within {timeout} s") from None
            raise
        command = pickle.loads(data)
        if isinstance(command, tuple) and len(command) == 2 and command[0] == "__parts__":
            command = pickle.loads(b"".join(self.client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000)
                                            for i in range(command[1])))
        self.taken += 1
        self.client.key_value_set(f"{self.prefix}/ack/{self.process}", str(self.taken), allow_overwrite=True)
        return command

    def drained(self, timeout: float) -> bool:
        """Leader: wait up to `timeout` s until every follower has taken every command published (so a
        last "stop" is read before process 0, and with it the coordination service, goes away)."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect()
            if self._deleted >= self.sent:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _collect(self) -> None:
        """Delete the commands every follower has taken."""
        if self.processes == 1:
            low = self.sent
        else:
            acks = []
            for p in range(1, self.processes):
                try:
                    acks.append(int(self.client.key_value_try_get(f"{self.prefix}/ack/{p}")))
                except Exception:  # noqa: BLE001 (no ack yet: NOT_FOUND)
                    acks.append(0)
            low = min(acks)
        for n in range(self._deleted, low):
            self.client.key_value_delete(f"{self.prefix}/cmd/{n}")
            for i in range(self._parts.pop(n, 0)):
                self.client.key_value_delete(f"{self.prefix}/cmd/{n}/{i}")
        self._deleted = max(self._deleted, low)


class Watchdog:
    """Heartbeats from every process; process 0 calls `on_dead([ids])` when some stop for `timeout` s."""

    def __init__(self, on_dead=None, *, timeout: float = 10.0, interval: float = 0.5, prefix: str = "dsv41/heartbeat"):
        import jax

        if not interval < timeout:
            raise ValueError(f"the heartbeat interval ({interval} s) must be below the timeout ({timeout} s)")
        self.client, self.prefix = _client(), prefix
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.on_dead, self.timeout, self.interval = on_dead, timeout, interval
        self.dead: list[int] = []
        self.seen: dict[int, tuple] = {}  # process 0: process -> (its last counter, when it last moved)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dsv41-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    def status(self) -> list[dict]:
        """Process 0's view, one entry per process: {"process", "alive", "heartbeat_age_s"} (the seconds
        since its counter last moved; None for this process)."""
        now = time.monotonic()
        out = [{"process": self.process, "alive": True, "heartbeat_age_s": None}]
        for p, (_, since) in sorted(dict(self.seen).items()):
            out.append({"process": p, "alive": p not in self.dead, "heartbeat_age_s": round(now - since, 1)})
        return sorted(out, key=lambda e: e["process"])

    def _beat(self) -> None:
        self.client.key_value_increment(f"{self.prefix}/{self.process}", 1)

    def _count(self, p: int) -> int | None:
        try:
            return int(self.client.key_value_try_get(f"{self.prefix}/{p}"))
        except Exception:  # noqa: BLE001 (no beat yet)
            return None

    def _run(self) -> None:
        seen = self.seen
        seen.update({p: (None, time.monotonic()) for p in range(self.processes) if p != self.process})
        while not self._stop.is_set():
            try:
                self._beat()
            except Exception:  # noqa: BLE001 (the coordination service is gone: process 0 died)
                if self.process != 0 and self.on_dead is not None:
                    self.dead = [0]
                    self.on_dead([0])
                return
            if self.process == 0:
                now, late = time.monotonic(), []
                for p, (count, since) in seen.items():
                    c = self._count(p)
                    if c != count:
                        seen[p] = (c, now)
                    elif now - since > self.timeout:
                        late.append(p)
                if late:
                    self.dead = late
                    if self.on_dead is not None:
                        self.on_dead(late)
                    return
            self._stop.wait(self.interval)


# ---------------------------------------------------------------------------------- serving

def portable(req):
    """The request as a command carries it: no callables, no host-only state. Its constraint goes
    as the `constraints.GrammarSpec` that built it (each follower builds its own matcher, `follow`);
    the files it names are sent along by `LeaderEngine`, since another host cannot read process 0's
    disk; its image spans (rows from the tower process 0 ran in lockstep) go as they are."""
    spec = None if req.constraint is None else req.constraint.spec
    if req.constraint is not None and spec is None:
        raise ValueError("a constraint built from a bare matcher cannot be sent to the other processes: build it "
                         "with constraints.Grammars.constraint")
    return dataclasses.replace(req, on_token=None, constraint=spec)


def _file(path) -> bytes | None:
    return None if path is None else pathlib.Path(path).read_bytes()


class LeaderEngine:
    """Process 0's engine across processes: every call that runs device code (or queues work for a
    step) is published on `channel` before it is made, so the followers (`follow`) make it too.

    Everything else (occupancy, the done table, the config, `idle`) is the engine's own: those
    read host state that every process keeps identically. A conversation's stored cache file
    (`resume_from`) travels with its submit (another host cannot read process 0's disk); the
    followers write what they save to scratch files (the gather inside `prefix_cache.save_prefix`
    is a collective every process must join) and delete them.

    A step that raises while the watchdog is deciding whether a process died waits for its verdict
    (`watchdog.timeout` plus a margin): the watchdog then answers the open requests naming the
    process and ends this one, rather than the step's bare collective error."""

    def __init__(self, engine, channel: Channel, watchdog: "Watchdog | None" = None):
        self.engine, self.channel, self.watchdog = engine, channel, watchdog
        # a call is published and made under this lock: calls from several threads (the server makes
        # all of its own on its engine thread) then run their device programs in the order the
        # followers read them
        self.lock = threading.RLock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def local(self):
        """The engine itself (warm-up runs it on every process without publishing)."""
        return self.engine

    def submit(self, req) -> str:
        with self.lock:
            rid = self.engine.submit(req)  # refused here (ValueError, 400) before anything is published
            self.channel.publish(("submit", portable(req), _file(req.resume_from)))
            return rid

    def cancel(self, request_id: str) -> bool:
        with self.lock:
            self.channel.publish(("cancel", request_id))
            return self.engine.cancel(request_id)

    def reset(self) -> list[str]:
        with self.lock:
            self.channel.publish(("reset",))
            return self.engine.reset()

    def step(self):
        with self.lock:
            self.channel.publish(("step",))
            try:
                results = self.engine.step()
            except Exception:
                self._await_watchdog()
                raise
            for r in results:
                if r.finish_reason == "error":  # failed on process 0 alone (its token callback): drop the copies
                    self.channel.publish(("cancel", r.request_id))
            return results

    def prefill(self, req):
        """A conversation-cache prefill (`ConversationStore._store_prefix`): the followers prefill too,
        and save the row to a scratch file, as process 0's store then saves it (`save_prefix`'s gather)."""
        with self.lock:
            self.channel.publish(("prefill", portable(req), _file(req.resume_from)))
            return self.engine.prefill(req)

    def prompt_logprobs(self, prompt: list[int]):
        """Echo's scoring pass (`Engine.prompt_logprobs`): the followers run the same pieces."""
        with self.lock:
            self.channel.publish(("prompt_logprobs", list(prompt)))
            return self.engine.prompt_logprobs(prompt)

    def encode_image(self, patches, n_vit_h: int, n_vit_w: int):
        """An image through the tower (`Engine.encode_image`), from a request's own thread: the
        followers run the same program; the span rows built from its output travel with the submit."""
        with self.lock:
            self.channel.publish(("encode_image", patches, n_vit_h, n_vit_w))
            return self.engine.encode_image(patches, n_vit_h, n_vit_w)

    def _await_watchdog(self) -> None:
        wd = self.watchdog
        if wd is None:
            return
        deadline = time.monotonic() + wd.timeout + 4 * wd.interval + 1.0
        while not wd.dead and time.monotonic() < deadline:
            time.sleep(wd.interval)
        while wd.dead:  # the watchdog's on_dead answers the open requests and ends the process
            time.sleep(1.0)


def follow(engine, channel: Channel, *, poll: float = 60.0, log=None, grammars=None) -> int:
    """A follower's loop: make process 0's engine calls in order until it says stop (returns 0).
    Raises what the channel raises when process 0 is gone (the caller exits non-zero).
    grammars: callable() -> `constraints.Grammars` of the served tokenizer, called on the first
    constrained request (each follower builds its own matchers from the requests' GrammarSpecs)."""
    import tempfile

    log = log or (lambda msg: print(f"dsv41 serve (process {channel.process}): {msg}", file=sys.stderr, flush=True))
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"dsv41-follower{channel.process}-"))
    owned: dict[str, list[pathlib.Path]] = {}  # request id -> its scratch files

    def local(req, data, tag):
        rid = req.request_id
        files = owned.setdefault(rid, [])
        if data is not None:  # process 0's stored conversation, written where this process reads it
            path = scratch / f"resume-{tag}-{len(files)}.dsv41"
            path.write_bytes(data)
            files.append(path)
            req.resume_from = str(path)
        if req.save_to is not None:  # saved here too (its gather is a collective), then deleted
            req.save_to = str(scratch / f"save-{tag}.dsv41")
            files.append(pathlib.Path(req.save_to))
        if req.constraint is not None:  # the same matcher as process 0's, advanced by the same tokens
            if grammars is None:
                raise ValueError("a constrained request reached a follower started without grammars")
            req.constraint = grammars().constraint(req.constraint.grammar, start_after=req.constraint.start_after)
        return req

    def forget(rid):
        for path in owned.pop(rid, []):
            path.unlink(missing_ok=True)

    prefills = 0
    try:
        while True:
            try:
                cmd = channel.receive(timeout=poll)
            except TimeoutError:
                continue
            kind = cmd[0]
            try:
                if kind == "submit":
                    req = local(cmd[1], cmd[2], cmd[1].request_id)
                    engine.submit(req)
                elif kind == "step":
                    for r in engine.step():
                        engine.done.pop(r.request_id, None)
                        forget(r.request_id)
                elif kind == "cancel":
                    engine.cancel(cmd[1])
                    forget(cmd[1])
                elif kind == "reset":
                    engine.reset()
                    for rid in list(owned):
                        forget(rid)
                elif kind == "prefill":
                    prefills += 1
                    tag = f"prefill{prefills}"
                    req = local(dataclasses.replace(cmd[1], request_id=tag), cmd[2], tag)
                    _, row, tokens, _ = engine.prefill(req)
                    prefix_cache.save_prefix(scratch / f"{tag}.dsv41", engine.cfg, row, tokens,
                                             fingerprint=engine.fingerprint, rings=engine.row_rings)
                    (scratch / f"{tag}.dsv41").unlink(missing_ok=True)
                    forget(tag)
                elif kind == "prompt_logprobs":
                    engine.prompt_logprobs(cmd[1])
                elif kind == "encode_image":
                    engine.encode_image(*cmd[1:])
                elif kind == "stop":
                    return 0
                else:
                    raise ValueError(f"unknown command {kind!r} from process 0")
            except Exception:  # noqa: BLE001 - process 0 made the same call: it fails there too, and resets
                log(f"the {kind} command failed here:\n{traceback.format_exc()}")
    finally:
        for rid in list(owned):
            forget(rid)
        for path in scratch.iterdir():
            path.unlink(missing_ok=True)
        os.rmdir(scratch)

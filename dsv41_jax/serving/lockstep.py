"""Process 0's host decisions, in order, on every process; and a watchdog for a process that dies.

The building block for serving across processes (issue 25 item 1; not yet wired into
`dsv41 serve`): process 0 owns HTTP and the scheduler, and every engine call it makes (a submit
with its sampling seed fixed, a cancel, a step, a reset) must reach the other processes before
the step's collectives run, so that they run the same jitted programs on their shards.

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

import pickle
import threading
import time


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

    def publish(self, command) -> int:
        """Leader only: append `command` (picklable; no callables); returns its number."""
        if self.process != 0:
            raise RuntimeError(f"only process 0 publishes commands; this is process {self.process}")
        n = self.sent
        self.client.key_value_set_bytes(f"{self.prefix}/cmd/{n}", pickle.dumps(command))
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
        self.taken += 1
        self.client.key_value_set(f"{self.prefix}/ack/{self.process}", str(self.taken), allow_overwrite=True)
        return pickle.loads(data)

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
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dsv41-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    def _beat(self) -> None:
        self.client.key_value_increment(f"{self.prefix}/{self.process}", 1)

    def _count(self, p: int) -> int | None:
        try:
            return int(self.client.key_value_try_get(f"{self.prefix}/{p}"))
        except Exception:  # noqa: BLE001 (no beat yet)
            return None

    def _run(self) -> None:
        seen = {p: (None, time.monotonic()) for p in range(self.processes) if p != self.process}
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

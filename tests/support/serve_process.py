"""`dsv41 serve` subprocesses for the server tests: start each on a free port, wait until each answers
/ready, stop them all."""
from __future__ import annotations

import fcntl
import pathlib
import random
import socket
import subprocess
import tempfile
import time

import httpx
import pytest

# Ports for the servers come from below the kernel's ephemeral range, so no client connection and no
# bind(0) (free_port) takes one while its server loads and compiles (tens of seconds before it binds),
# and each is reserved with a lock file for as long as its server runs, so the other xdist worker's
# servers skip it. (With free_port(), two server tests raced: "address already in use".) A server that
# still finds its port taken (by a process outside the tests) is started again on another, up to
# BIND_TRIES times: uvicorn exits with BIND_ERROR in its log then.
BIND_ERROR = "address already in use"
BIND_TRIES = 3
_LOCK_DIR = pathlib.Path(tempfile.gettempdir()) / "dsv41-test-ports"
_held: dict = {}  # Popen -> the open lock file of its port


def reserve_port() -> tuple[int, object]:
    """A port below the ephemeral range that binds now and that no other test process holds: (port, lock)."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default lower bound
    ports = list(range(max(1024, low - 8000), low))
    random.shuffle(ports)
    _LOCK_DIR.mkdir(exist_ok=True)
    for port in ports:
        lock = open(_LOCK_DIR / str(port), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return port, lock
        except OSError:
            lock.close()
    raise RuntimeError(f"no free port in {ports[0]}..{low - 1} for a test server")


def launch(starts: dict, procs: dict, urls: dict) -> None:
    """Start each server: starts[name](port) -> Popen, on a reserved port; fills procs and urls in place
    (the caller's `finally: stop(procs)` then sees every process started and frees its port)."""
    for name, start in starts.items():
        port, lock = reserve_port()
        try:
            procs[name] = start(port)
        except BaseException:
            lock.close()
            raise
        _held[procs[name]] = lock
        urls[name] = f"http://127.0.0.1:{port}"


def wait_ready(procs: dict, urls: dict, logs: dict, timeout: float = 900, starts: dict | None = None) -> None:
    """Poll each server's /ready until 200 (a 503 must say "warming"); a server that exits or is not ready
    within `timeout` seconds fails the test with the tail of its stderr log. With `starts` (as given to
    launch), a server that exited because its port was taken is started again on another port (urls
    updated in place)."""
    deadline = time.monotonic() + timeout
    for name in list(urls):
        tries = 1
        while True:
            url = urls[name]
            try:
                r = httpx.get(url + "/ready")
                if r.status_code == 200:
                    break
                assert r.json()["status"] == "warming", f"dsv41 serve ({name}): {r.json()}"
            except httpx.HTTPError:
                pass
            if (procs[name].poll() is not None and starts is not None and tries < BIND_TRIES
                    and BIND_ERROR in pathlib.Path(logs[name]).read_text()):
                _release(procs[name])
                launch({name: starts[name]}, procs, urls)
                tries += 1
                continue
            if procs[name].poll() is not None or time.monotonic() > deadline:
                procs[name].kill()
                pytest.fail(f"dsv41 serve ({name}) did not come up: exit code {procs[name].poll()}\n"
                            + pathlib.Path(logs[name]).read_text()[-4000:])
            time.sleep(0.5)


def _release(proc) -> None:
    lock = _held.pop(proc, None)
    if lock is not None:
        lock.close()


def stop(procs: dict) -> None:
    """Terminate every server, then kill those still running after 60 s; free their ports."""
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        _release(p)

"""`dsv41 serve` subprocesses for the server tests: wait until each answers /ready, stop them all."""
from __future__ import annotations

import pathlib
import subprocess
import time

import httpx
import pytest


def wait_ready(procs: dict, urls: dict, logs: dict, timeout: float = 900) -> None:
    """Poll each server's /ready until 200 (a 503 must say "warming"); a server that exits or is not ready
    within `timeout` seconds fails the test with the tail of its stderr log."""
    deadline = time.monotonic() + timeout
    for name, url in urls.items():
        while True:
            try:
                r = httpx.get(url + "/ready")
                if r.status_code == 200:
                    break
                assert r.json()["status"] == "warming", f"dsv41 serve ({name}): {r.json()}"
            except httpx.HTTPError:
                pass
            if procs[name].poll() is not None or time.monotonic() > deadline:
                procs[name].kill()
                pytest.fail(f"dsv41 serve ({name}) did not come up: exit code {procs[name].poll()}\n"
                            + pathlib.Path(logs[name]).read_text()[-4000:])
            time.sleep(0.5)


def stop(procs: dict) -> None:
    """Terminate every server, then kill those still running after 60 s."""
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()

"""serving.lockstep across two real processes on 127.0.0.1 (no model: only the coordination service).

Process 0 publishes commands that process 1 receives in order; the store keeps only commands not
yet acknowledged; when process 1 is killed, process 0's watchdog names it (the test bounds only
that it ends, generously, not how fast).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

SCENARIO = r'''
import json, sys, time
from dsv41_jax.cli.distributed import join
import argparse
pid = int(sys.argv[2])
join(argparse.Namespace(coordinator=sys.argv[1], num_processes=2, process_id=pid), "lockstep")
from dsv41_jax.serving.lockstep import Channel, Watchdog
ch = Channel()
dead = []
wd = Watchdog(lambda ids: dead.extend(ids), timeout=3.0, interval=0.2).start()
if pid == 0:
    big = ("file", bytes(range(256)) * 12289)  # over 3 MiB: stored in parts (lockstep.CHUNK each)
    for n, cmd in enumerate([("submit", {"prompt": [1, 2, 3], "seed": 7}), ("step",), big, ("cancel", "r0")]):
        assert ch.publish(cmd) == n
    deadline = time.monotonic() + 120  # process 1 acknowledges all four, then the store is empty
    while ch._deleted < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
        ch._collect()
    time.sleep(4.0)  # longer than the watchdog's timeout: a live process is not reported
    print(json.dumps({"deleted": ch._deleted, "dead": list(dead)}), flush=True)
    ch.publish(("ready-to-die",))
    t0 = time.monotonic()
    while not dead and time.monotonic() - t0 < 300:
        time.sleep(0.05)
    print(json.dumps({"dead": dead}), flush=True)
    import os
    os._exit(0)  # not jax.distributed.shutdown: its barrier would wait for the dead process
else:
    got = [ch.receive(timeout=120) for _ in range(4)]
    assert got[2] == ("file", bytes(range(256)) * 12289), "the command stored in parts came back whole"
    print(json.dumps({"got": got[:2] + got[3:]}), flush=True)
    ch.receive(timeout=120)
    print("waiting to be killed", flush=True)
    time.sleep(600)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_commands_in_order_and_a_killed_process_is_named(tmp_path):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", SCENARIO, f"127.0.0.1:{port}", str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=open(tmp_path / f"err{i}", "w"), text=True)
             for i in range(2)]
    try:
        follower = procs[1]
        assert json.loads(follower.stdout.readline()) == {"got": [["submit", {"prompt": [1, 2, 3], "seed": 7}],
                                                                  ["step"], ["cancel", "r0"]]}
        assert json.loads(procs[0].stdout.readline()) == {"deleted": 4, "dead": []}
        assert follower.stdout.readline().strip() == "waiting to be killed"
        follower.send_signal(signal.SIGKILL)
        follower.wait()
        out, _ = procs[0].communicate(timeout=300)
        assert json.loads(out.strip().splitlines()[-1]) == {"dead": [1]}, (tmp_path / "err0").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

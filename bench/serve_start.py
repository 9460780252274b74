"""Start-up of `dsv41 serve`: cold start, cached start and the first requests after ready.

    python bench/serve_start.py --checkpoint OUT/served [--json start.json]

Runs `dsv41 serve` as a separate process twice with the same, initially empty, compilation cache
folder (`--compile-cache`): the first start compiles every program (cold), the second loads them
(cached). For each start it records the seconds from launching the process to `/health` (alive)
and to `/ready` (warm), then sends, with the real `openai` client, a short chat request, a request
with `tools` (the tool prompt is over 1K tokens on the demo's byte tokenizer) and a thinking-mode
request, one at a time, and records each one's latency (`max_tokens` 16). Prints a table; `--json`
also writes the figures. `dsv41 demo --out OUT` makes the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "look up a fact about a city: weather, population, history or transport " * 3,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city name"},
                                                    "units": {"type": "string", "enum": ["metric", "imperial"]}},
                   "required": ["city"]}}} for i in range(4)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, path: str, proc, deadline: float) -> float:
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dsv41 serve exited with code {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} not 200 in time")


def one_start(checkpoint: str, cache: str, timeout: float) -> dict:
    from openai import OpenAI

    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_jax.cli.main", "serve", "--checkpoint", checkpoint,
                             "--port", str(port), "--compile-cache", cache, "--max-batch", "2"],
                            stdout=log, stderr=log, text=True, env=dict(os.environ))
    try:
        alive = _wait(url, "/health", proc, t0 + timeout) - t0
        ready = _wait(url, "/ready", proc, t0 + timeout) - t0
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout)
        model = client.models.list().data[0].id
        first = {}
        for name, extra in [("chat", {}), ("tools", {"tools": TOOLS}), ("thinking", {"reasoning_effort": "high"})]:
            t = time.monotonic()
            r = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                               **extra)
            first[name] = {"seconds": time.monotonic() - t, "prompt_tokens": r.usage.prompt_tokens}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        lines = [ln for ln in log.read().splitlines() if "dsv41 serve: warm-up" in ln]
        log.close()
    return {"alive_s": alive, "ready_s": ready, "first_requests": first, "programs": len(lines)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a served checkpoint folder (dsv41 demo writes OUT/served)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for each start (default 1800)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if not pathlib.Path(args.checkpoint).is_dir():
        print(f"serve_start: --checkpoint {args.checkpoint}: no such folder", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dsv41-compile-cache-") as cache:
        runs = {"cold": one_start(args.checkpoint, cache, args.timeout),
                "cached": one_start(args.checkpoint, cache, args.timeout)}
    print("| start | alive | ready | chat | tools | thinking |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        f = r["first_requests"]
        print(f"| {name} | {r['alive_s']:.1f} s | {r['ready_s']:.1f} s | {f['chat']['seconds']:.2f} s | "
              f"{f['tools']['seconds']:.2f} s ({f['tools']['prompt_tokens']} prompt tokens) | "
              f"{f['thinking']['seconds']:.2f} s |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

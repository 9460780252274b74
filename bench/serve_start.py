"""Start-up of `dsv41 serve`: cold start, cached start and the first requests after ready.

    python bench/serve_start.py --checkpoint OUT/served [--json start.json]

Runs `dsv41 serve` as a separate process twice with the same, initially empty, compilation cache
folder (`--compile-cache`): the first start compiles every program (cold), the second loads them
(cached). For each start it records the seconds from launching the process to `/health` (alive)
and to `/ready` (warm), then sends, with the real `openai` client, a short chat request, a request
with `tools` (the tool prompt is over 1K tokens on the demo's byte tokenizer) and a thinking-mode
request, one at a time, and records each one's latency (`max_tokens` 16). Then, with conversation
caches on (`--prefix-cache-dir`), a 1,500-token prompt (stored), the same prompt plus 40 tokens
(resumed from the stored file: load and replay, then the 40) and another prompt of the same
1,540 tokens from scratch, one output token each. Prints a table; `--json` also writes the
figures and each start's log lines stamped with their seconds since launch (where a start spends
its time: imports, the checkpoint load, each warm-up program). `dsv41 demo --out OUT` makes the checkpoint.
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
import threading
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


def _resume_vs_scratch(url: str, model: str, timeout: float) -> dict:
    """Seconds of a conversation-cache resume and of the same-length prompt from scratch."""
    import httpx

    ids = lambda seed, n: [(seed + 7 * i) % 240 + 10 for i in range(n)]  # noqa: E731 - byte-level ids
    stored, more = ids(1, 1500), ids(5, 40)
    out = {}
    for name, prompt in [("store", stored), ("resume", stored + more), ("scratch", ids(3, 1500) + more)]:
        t = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                      "temperature": 0}, timeout=timeout)
        r.raise_for_status()
        out[name] = {"seconds": time.monotonic() - t,
                     "cached_tokens": (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
    return out


def one_start(checkpoint: str, cache: str, timeout: float) -> dict:
    from openai import OpenAI

    port = _port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_jax.cli.main", "serve", "--checkpoint", checkpoint,
                             "--port", str(port), "--compile-cache", cache, "--max-batch", "2",
                             "--prefix-cache-dir", tempfile.mkdtemp(prefix="dsv41-conversations-")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    log = []  # (seconds since launch, line): where a start spends its time (read at once: a full pipe stalls)
    reader = threading.Thread(target=lambda: log.extend((round(time.monotonic() - t0, 2), ln.rstrip())
                                                        for ln in proc.stdout), daemon=True)
    reader.start()
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
        conversation = _resume_vs_scratch(url, model, timeout)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(30)
    lines = [ln for _, ln in log if "dsv41 serve: warm-up" in ln]
    return {"alive_s": alive, "ready_s": ready, "first_requests": first, "programs": len(lines),
            "conversation": conversation, "log": log}


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
    print("| start | alive | ready (programs) | chat | tools | thinking | resume 1,540 (cached) | scratch 1,540 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        f, c = r["first_requests"], r["conversation"]
        print(f"| {name} | {r['alive_s']:.1f} s | {r['ready_s']:.1f} s ({r['programs']}) | {f['chat']['seconds']:.2f} s | "
              f"{f['tools']['seconds']:.2f} s ({f['tools']['prompt_tokens']} prompt tokens) | "
              f"{f['thinking']['seconds']:.2f} s | {c['resume']['seconds']:.2f} s ({c['resume']['cached_tokens']}) | "
              f"{c['scratch']['seconds']:.2f} s |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

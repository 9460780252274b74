"""Clients nobody here wrote, against a running `dsv41 serve`: the figures of docs/SERVING.md "Real clients".

    dsv41 demo --out D && dsv41 serve --checkpoint D/served --port 8000 &
    python bench/clients.py --url http://127.0.0.1:8000 --tokenizer D/served [--json]

Each check prints one line (and `--json` one object at the end):
- lm-eval: `local-completions` with its defaults (tokenized requests) on a local multiple-choice task; every
  score it reports against the sum of the server's own echo logprobs of the same ids (equal bit for bit).
- tools: the `openai` client with `tool_choice` required and named, a string parameter with and without
  `maxLength`, at several `max_tokens`: each answer has its tool call (whole, or cut with finish_reason
  "length"), or is a 400 before any compute naming the budget the call needs; never nothing.
- defaults: a completion without `max_tokens` stops at 16 tokens (OpenAI's default).
- disconnect: a client that gives up (streaming and not): seconds until `dsv41_running_requests` is 0 again.
- schemathesis: `--checks all` on every endpoint (the hooks of tests/support/schemathesis_hooks.py).
- hostile bodies: 100,000 levels of nesting in `messages` and in `metadata`; a 50 MB body sent by `urllib`,
  which writes the whole body before it reads.
Exit status: 0 when every check holds, 1 otherwise, 2 bad arguments or no server at --url.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [{"q": "import o", "choices": ["s", "x", "sys"], "gold": 0},
        {"q": "def f(x):\n    return", "choices": [" x", " 1", " None"], "gold": 0},
        {"q": "for i in range(", "choices": ["10", "n", "len(x)"], "gold": 0}]


def _post(a, path: str, body: dict, timeout: float = 600) -> httpx.Response:
    return httpx.post(a.url + path, json=body, timeout=timeout, headers=_auth(a))


def _auth(a) -> dict:
    return {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}


def check_lm_eval(a) -> dict:
    """Every lm-eval score equals the server's echo logprobs of the same tokens."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    folder = pathlib.Path(tempfile.mkdtemp(prefix="lmeval-"))
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    (folder / "mc_local.yaml").write_text(
        f"task: mc_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")
    out = simple_evaluate(model="local-completions", tasks=["mc_local"], log_samples=True,
                          task_manager=TaskManager(include_path=str(folder)),
                          model_args={"base_url": a.url + "/v1/completions", "model": a.model,
                                      "tokenizer": a.tokenizer, "max_length": 4096})
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    equal = total = 0
    for sample in out["samples"]["mc_local"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            r = _post(a, "/v1/completions", {"model": a.model, "prompt": whole, "echo": True, "logprobs": 1,
                                             "max_tokens": 0})
            echo = sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])
            equal += resp[0][0] == echo
            total += 1
    return {"ok": total > 0 and equal == total, "scores_equal": equal, "scores": total,
            "acc": out["results"]["mc_local"].get("acc,none")}


def check_tools(a) -> dict:
    """Forced tool calls at budgets from too small to ample: never an answer without its call."""
    import openai

    client = openai.OpenAI(base_url=a.url + "/v1", api_key=a.api_key or "none", max_retries=0, timeout=900)
    cases, dropped = [], 0
    for bound in (None, 16):
        city = {"type": "string", **({"maxLength": bound} if bound else {})}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": city}, "required": ["city"]}}}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            for max_tokens in (8, 96, 400):
                try:
                    r = client.chat.completions.create(
                        model=a.model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                        tool_choice=choice, max_tokens=max_tokens, temperature=0)
                    c = r.choices[0]
                    outcome = f"{c.finish_reason}, {len(c.message.tool_calls or [])} call(s)"
                    dropped += not c.message.tool_calls
                except openai.BadRequestError as e:
                    outcome = "400: " + str(e.body.get("message", e))[:100]
                    dropped += "budget" not in outcome and "tokens" not in outcome
                cases.append({"maxLength": bound, "choice": "required" if choice == "required" else "named",
                              "max_tokens": max_tokens, "outcome": outcome})
    return {"ok": dropped == 0, "dropped": dropped, "cases": cases}


def check_default_max_tokens(a) -> dict:
    r = _post(a, "/v1/completions", {"model": a.model, "prompt": "Once upon a time", "temperature": 0})
    n = r.json()["usage"]["completion_tokens"]
    return {"ok": r.status_code == 200 and n <= 16, "completion_tokens": n}


def _running(a) -> float:
    text = httpx.get(a.url + "/metrics", headers=_auth(a), timeout=30).text
    m = re.search(r"^dsv41_running_requests(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def check_disconnect(a) -> dict:
    """A client that gives up after 3 s: seconds until no request runs."""
    out = {}
    for stream in (False, True):
        body = {"model": a.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000, "stream": stream, "temperature": 1}
        try:
            with httpx.stream("POST", a.url + "/v1/completions", json=body, headers=_auth(a), timeout=3) as r:
                for _ in r.iter_bytes():
                    pass
        except httpx.TimeoutException:
            pass
        gone = time.monotonic()
        while _running(a) > 0 and time.monotonic() - gone < 120:
            time.sleep(0.05)
        out["streaming" if stream else "whole"] = round(time.monotonic() - gone, 2)
    return {"ok": all(v < 5 for v in out.values()), "seconds_until_free": out}


def check_schemathesis(a) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks"}
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", a.url + "/openapi.json", "--checks", "all",
                          *(["-H", f"Authorization: Bearer {a.api_key}"] if a.api_key else []),
                          "--max-examples", str(a.examples), "--workers", "1", "--seed", "20261204",
                          "--request-timeout", "300", "--continue-on-failure", "--no-color"],
                         env=env, capture_output=True, text=True, cwd=tempfile.mkdtemp())  # its cache outside the repo
    m = re.search(r"(\d+) generated, (.*)", run.stdout)
    return {"ok": run.returncode == 0, "summary": m.group(0) if m else run.stdout[-400:]}


def check_hostile(a) -> dict:
    deep = "[" * 100_000 + "]" * 100_000
    out = {}
    for field in ("messages", "metadata"):
        body = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "metadata": {"x": %s}}'
                % (a.model, deep) if field == "metadata" else '{"model": "%s", "messages": %s}' % (a.model, deep))
        r = httpx.post(a.url + "/v1/chat/completions", content=body, timeout=120,
                       headers={**_auth(a), "Content-Type": "application/json"})
        out[f"nested_{field}"] = r.status_code
    req = urllib.request.Request(a.url + "/v1/completions", data=b"x" * (50 << 20), method="POST",
                                 headers={**_auth(a), "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120)
        out["urllib_50MB"] = "accepted"
    except urllib.error.HTTPError as e:
        out["urllib_50MB"] = f"{e.code} {json.loads(e.read())['error']['message'][:60]}"
    except OSError as e:
        out["urllib_50MB"] = f"connection error: {e}"
    ok = out["nested_messages"] == 400 and out["nested_metadata"] == 400 and str(out["urllib_50MB"]).startswith("413")
    return {"ok": ok, **out}


CHECKS = {"lm_eval": check_lm_eval, "tools": check_tools, "defaults": check_default_max_tokens,
          "disconnect": check_disconnect, "schemathesis": check_schemathesis, "hostile": check_hostile}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the served model id (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", help="the checkpoint folder with tokenizer.json (for lm-eval)")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated, of {','.join(CHECKS)}")
    p.add_argument("--examples", type=int, default=100, help="schemathesis examples per operation")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    only = a.only.split(",")
    if unknown := [c for c in only if c not in CHECKS]:
        p.error(f"--only: unknown check(s) {unknown}; choose from {list(CHECKS)}")
    if "lm_eval" in only and not a.tokenizer:
        p.error("--tokenizer: lm-eval needs the checkpoint folder that holds tokenizer.json")
    try:
        models = httpx.get(a.url + "/v1/models", headers=_auth(a), timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        print(f"clients: no server answers at {a.url} ({e}); start `dsv41 serve` first", file=sys.stderr)
        return 2
    a.model = a.model or models[0]["id"]
    results = {}
    for name in only:
        t0 = time.monotonic()
        results[name] = {**CHECKS[name](a), "seconds": round(time.monotonic() - t0, 1)}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if a.json:
        print(json.dumps(results))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

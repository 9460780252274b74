"""Load generator for `dsv41 serve`: bounded streaming requests at several concurrencies, mixed
prompt and output lengths, and two-turn conversations that reuse the conversation cache.

    python bench/serve.py                       # starts a tiny synthetic server in-process (CPU)
    python bench/serve.py --url http://HOST:8000 --model NAME --concurrency 1,8,64

Prints, per concurrency: requests, output tokens per second, p50/p90/p99 time to first token
and inter-token latency (measured by the client from SSE chunk arrival); then the time to first
token of a follow-up turn with and without its conversation cache, as a ratio from one run.
`--json` prints the same as one object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

WORDS = "the weather in paris is sunny today and the answer is forty two more or less".split()


def _percentiles(xs) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(xs)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


async def _one(client, model: str, messages, max_tokens: int, **kw) -> dict:
    t0 = time.perf_counter()
    times = []
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True}, **kw)
    usage, text = None, ""
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.model_extra.get("reasoning")):
            times.append(time.perf_counter())
            text += chunk.choices[0].delta.content or ""
    end = time.perf_counter()
    return {"ttft": (times[0] if times else end) - t0, "itl": list(np.diff(times)), "total": end - t0,
            "tokens": usage.completion_tokens if usage else len(times),
            "cached": usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0,
            "text": text}


def _prompt(rng, n_words: int) -> list:
    return [{"role": "user", "content": " ".join(rng.choice(WORDS, n_words))}]


async def load_level(client, model: str, concurrency: int, requests: int, rng, lengths, outputs) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i):
        async with sem:
            return await _one(client, model, _prompt(rng, int(lengths[i % len(lengths)])),
                              int(outputs[i % len(outputs)]))

    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": requests, "wall_s": wall,
            "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_s": _percentiles([r["ttft"] for r in results]),
            "itl_s": _percentiles([x for r in results for x in r["itl"]])}


async def follow_up(client, model: str, rng, turns: int = 3) -> dict:
    """TTFT of a follow-up turn resumed from the conversation cache vs the same turn after the cache
    folder was emptied (the caller's `clear`), averaged over `turns` conversations. Thinking mode:
    the follow-up extends the first prompt whatever the (random) model replied."""
    cached, cold, hits = [], [], []
    think = {"reasoning_effort": "low"}
    for i in range(turns):
        first = _prompt(rng, 120)
        await _one(client, model, first, 8, **think)
        second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then"}]
        warm = await _one(client, model, second, 8, **think)
        cached.append(warm["ttft"])
        hits.append(warm["cached"])
        yield_ = yield second  # the driver clears the cache, then we send the same turn cold
        del yield_
        cold.append((await _one(client, model, second, 8, **think))["ttft"])
    yield {"ttft_cached_s": float(np.mean(cached)), "ttft_uncached_s": float(np.mean(cold)),
           "cached_tokens": hits, "ratio_uncached_over_cached": float(np.mean(cold) / np.mean(cached))}


def _tiny_server(cache_dir: str):
    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.serving.engine import EngineSettings
    from dsv41_jax.serving.http.server import BackgroundServer, ServeOptions, build
    from dsv41_jax.text.tokenizer import load_tokenizer
    from dsv41_jax.train.data import ByteTokenizer

    folder = pathlib.Path(tempfile.mkdtemp(prefix="dsv41-bench-"))
    tok = load_tokenizer(ByteTokenizer().save_json(folder / "tokenizer.json"))
    cfg = ModelConfig.tiny(vocab_size=ByteTokenizer().vocab_size, n_layers=2, compress_ratios=(0, 1),
                           kv_source_layers=(1,), index_source_layers=(1,), candidate_source_layer=1,
                           engram_layer_ids=(), index_topk=4, candidate_topk_blocks=2, candidate_block_size=4,
                           n_routed_experts=4, max_seq_len=1024, max_batch_size=64)
    opts = ServeOptions(model_name="tiny", engine=EngineSettings(slots=16, max_seq_len=1024, min_capacity=1024,
                                                                 prefill_chunk=64),
                        max_queue=1024, cache_dir=cache_dir, cache_bytes=1 << 28)
    app, worker = build(synthetic_model(cfg, seed=0), tok, opts)
    return BackgroundServer(app, worker).start()


async def main_async(args) -> dict:
    import openai

    srv = None
    if args.url is None:
        srv = _tiny_server(tempfile.mkdtemp(prefix="dsv41-bench-cache-"))
        args.url, args.model = srv.url, "tiny"
    client = openai.AsyncOpenAI(base_url=args.url + "/v1", api_key=args.api_key or "none", max_retries=0,
                                timeout=3600)
    rng = np.random.default_rng(args.seed)
    lengths, outputs = [5, 20, 60, 120], [4, 16, 32]
    for n in (*lengths, 120) if args.concurrency else (120,):  # compile the prefill shapes outside the measurements
        await _one(client, args.model, _prompt(rng, n), 2)
        await _one(client, args.model, _prompt(rng, n), 2, reasoning_effort="low")
    out = {"url": args.url, "levels": []}
    for c in args.concurrency:
        level = await load_level(client, args.model, c, args.requests or max(2 * c, 8), rng, lengths, outputs)
        out["levels"].append(level)
        print(f"concurrency {c:3d}: {level['requests']} requests, {level['output_tokens_per_s']:.1f} output tok/s, "
              f"TTFT p50 {level['ttft_s']['p50']:.3f}s p99 {level['ttft_s']['p99']:.3f}s, "
              f"ITL p50 {level['itl_s']['p50'] or 0:.4f}s p99 {level['itl_s']['p99'] or 0:.4f}s", file=sys.stderr)
    if srv is not None:
        store = srv.app.state.conversations
        for turns in (1, 3):  # the first pass compiles the resume (replay) path; only the second is kept
            gen = follow_up(client, args.model, rng, turns)
            item = await gen.__anext__()
            while isinstance(item, list):
                for path in list(store.files):  # engine thread is idle between requests here
                    store._drop(path)
                item = await gen.asend(None)
        out["follow_up"] = item
        print(f"follow-up turn TTFT: {item['ttft_cached_s']:.3f}s with the conversation cache, "
              f"{item['ttft_uncached_s']:.3f}s without ({item['ratio_uncached_over_cached']:.2f}x); cached tokens "
              f"{item['cached_tokens']}", file=sys.stderr)
        srv.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start a tiny synthetic one in-process)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="comma-separated levels ('' = only the follow-up measurement)")
    p.add_argument("--requests", type=int, help="requests per level (default: 2 x concurrency, at least 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

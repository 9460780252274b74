"""The serving engine: continuous batching over a fixed set of slots (docs/REFERENCE.md §5).

Each slot holds one sequence with its own position. Between decode steps the engine admits
waiting requests into free slots (their prompts are prefilled alone, in chunks, and the
one-row cache is written into the slot) and evicts finished ones. Prefill uses the CED split
(Graph A over every prompt token, Graph B over the last `window + tail_slack`) unless
`exact_prefill=True`. Decode is `split_prefill.decode_step` (the one layer body, `model.block`)
with `Engine.decode_plan` (pool scoring, packed fast index scoring, selected compressed rows gathered).

Every compiled step is a pure function of (params, inputs, cache) -> (outputs, cache); the host
keeps only the slot table. Compiled shapes: prefill chunks of `prefill_chunk` tokens plus
power-of-two remainders (so any prompt length reuses at most log2(prefill_chunk) + 1 chunk
shapes), one Graph B shape, one decode shape per cache capacity bucket (`buckets`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import dspark
from dsv41_jax.model.block import kernel_params
from dsv41_jax.model.transformer import COMPILER_OPTIONS
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import prefix_cache, speculation
from dsv41_jax.serving.buckets import capacity_for, empty_cache, resize_cache
from dsv41_jax.serving.sampling import (SamplingParams, banned_mask, check_finite_logits, empty_history, history_row,
                                        mask_words, sample, slot_arrays)
from dsv41_jax.serving.split_prefill import (check_splittable, commit, decode_plan, decode_step, decoder_pass,
                                             encoder_pass, exact_prefill, replay_window)


@dataclass
class Request:
    """A prompt to continue. With `resume_from`, the prompt continues the tokens stored in that
    prefix-cache file; with `save_to`, the sequence's global cache is stored when it finishes.

    `on_token(token, logprobs)` is called with every token as it is generated (for streaming);
    `logprobs` is the log-softmax row [V] (numpy float32, banned ids at -inf) when
    `want_logprobs`, else None. `forced_tokens` (tests only) replaces the first sampled tokens
    by these ids; the model still runs on them, so the engine's path is the production one.
    `constraint` (host side, e.g. `dsv41_jax.serving.constraints.Constraint`) limits what may be
    sampled: before each draw `constraint.fill(row)` writes the allowed ids into a packed int32
    row of `sampling.mask_words(V)` words (all ones on entry), and every kept token is passed to
    `constraint.advance(token)`. A row left all zero (the grammar cannot go on) allows only the
    stop tokens, so the reply ends.
    `spans` = (rows [len(prompt), dim], token_types [len(prompt)]) are the prompt's image spans
    (`dsv41_jax.vision.merge.span_rows`; type >= 0 inside a span), as `model.forward` takes them.
    With `resume_from`, `history_spans` are those of the stored tokens (the replayed window reads
    the rows of its image positions), and `match_key` (one int per stored-and-prompt token, image
    positions keyed by their pixels) is saved with `save_to`'s cache for conversation matching."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    resume_from: str | None = None
    save_to: str | None = None
    on_token: Callable | None = None
    want_logprobs: bool = False
    forced_tokens: tuple[int, ...] = ()
    spans: tuple | None = None
    constraint: object | None = None
    speculate: bool = True  # on an engine with speculation: False decodes this request token by token
    history_spans: tuple | None = None
    match_key: list[int] | None = None


@dataclass
class Result:
    """What came out: generated tokens, why it stopped, and timings in seconds."""

    request_id: str
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token, included), "length" (max_tokens) or "error" (see `error`)
    prompt_tokens: int
    cached_tokens: int  # tokens restored from a prefix cache
    timing: dict
    error: str | None = None  # why this request failed alone (finish_reason "error")
    exception: BaseException | None = None  # and the exception that said so (its type tells a caller what failed)


@dataclass
class _Slot:
    request: Request
    tokens: list[int]  # every token id of the sequence so far (cached + generated)
    in_cache: int  # how many of them went through the model
    generated: list[int]
    times: dict
    rings: bool = False  # its DSpark rings hold every position in the cache (speculation can start)


def pieces(n: int, chunk: int) -> list[int]:
    """Chunk sizes covering n tokens: whole chunks, then the remainder's powers of two."""
    out = [chunk] * (n // chunk)
    r = n % chunk
    bit = 1 << max(r.bit_length() - 1, 0)
    while r:
        if r & bit:
            out.append(bit)
            r -= bit
        bit >>= 1
    return out


def _spans(spans, lo: int, hi: int):
    """Rows lo..hi of a prompt's image spans as a batch of one, or None (no spans, or none in range)."""
    if spans is None or not np.any(np.asarray(spans[1])[lo:hi] >= 0):
        return None
    return jnp.asarray(np.asarray(spans[0])[None, lo:hi]), jnp.asarray(np.asarray(spans[1])[None, lo:hi], jnp.int32)


class Engine:
    """Continuous-batching generation over `slots` sequences. See the module doc."""

    def __init__(self, model, *, slots: int = 4, max_seq_len: int | None = None, min_capacity: int = 256,
                 prefill_chunk: int = 512, exact_prefill: bool = False, tail_slack: int = 0,
                 runtime: Runtime = Runtime(), banned_ids=(), engram=None, fingerprint: str | None = None,
                 mesh=None, preset: str = "inference", speculative: int = 0, spec_acceptance: str = "rejection",
                 engram_host: bool = False):
        """mesh: a `jax.sharding.Mesh` (`sharding.mesh.make_mesh("expert=4,tensor=2")`) to serve on,
        laid out by `preset` (the vocabulary of `dsv41 plan`); None = one device, as given.
        speculative: K > 0 drafts K tokens per step with the model's DSpark drafter for every slot
        that allows it (`serving.speculation`); the prefill's taps fill the drafter's rings (a split
        prefill's: Graph A's and Graph B's of the tail, whose newest W positions are all a ring holds).
        spec_acceptance at T > 0: "rejection" (rejection sampling, the target distribution) or "match"
        (a draft must equal the target's own draw: the same tokens as without speculation).
        engram_host: keep the Engram tables in host memory (`sharding.engram_shard.HostEngramTables`,
        `dsv41 serve --engram host`): each step's hash ids are known before it runs, so only the rows
        it reads go to the device, as a compact table per layer (`_step_params`); the numbers are the
        HBM engine's, bit for bit."""
        cfg = model.cfg
        if speculative:
            dspark.require_dspark(model)
            if not 1 <= speculative <= cfg.dspark_block_size:
                raise ValueError(f"speculative={speculative}: the drafter proposes 1 .. {cfg.dspark_block_size} "
                                 f"tokens per block (dspark_block_size)")
        if spec_acceptance not in ("rejection", "match"):
            raise ValueError(f"spec_acceptance={spec_acceptance!r}: expected 'rejection' or 'match'")
        self.K, self.spec_acceptance = speculative, spec_acceptance
        self.cfg, self.runtime = cfg, runtime
        self.host_engram = None
        if engram_host:
            if not cfg.engram_layer_ids:
                raise ValueError("engram_host=True (--engram host) but this model has no Engram layers "
                                 "(engram_layer_ids is empty); drop the option")
            from sharding.engram_shard import split_host_tables, unpadded_tables

            # the fingerprint of the whole model (tables included), as an HBM engine computes it
            fingerprint = fingerprint or prefix_cache.model_fingerprint(unpadded_tables(nnx.state(model), cfg))
            model, self.host_engram = split_host_tables(model, cfg)
        self.placement = None
        if mesh is not None:
            from sharding.serving import MeshPlacement

            self.placement = MeshPlacement(model, mesh, preset, engram_host=engram_host)
            self.graphdef, self.params = self.placement.graphdef, self.placement.params
        else:
            self.graphdef, self.params = nnx.split(model)
        # where replicated inputs go (`placed`, the compact Engram tables): over the params' devices
        home = mesh if mesh is not None else next(l.sharding for l in jax.tree.leaves(self.params)
                                                  if isinstance(l, jax.Array))
        if isinstance(home, jax.sharding.NamedSharding):
            home = home.mesh
        self.replicated = (jax.sharding.NamedSharding(home, jax.sharding.PartitionSpec())
                           if isinstance(home, jax.sharding.Mesh) else home)
        self.slots = slots
        self.max_seq_len = max_seq_len or cfg.max_seq_len
        self.min_capacity = min_capacity
        self.prefill_chunk = prefill_chunk
        self.exact = exact_prefill
        if not exact_prefill:
            check_splittable(cfg)
        self.tail = cfg.window_size + tail_slack
        if cfg.engram_layer_ids and engram is None:
            raise ValueError("this config has Engram layers: pass engram=(layout, token_map) "
                             "(dsv41_jax.engram.hashing.EngramLayout and the token map)")
        self.engram = engram
        # the decode step's plan, compiled into it
        self.decode_plan = decode_plan(runtime)
        self.banned = jnp.asarray(banned_mask(cfg.vocab_size, banned_ids))
        # per-slot sampling state on device: what the penalties count (sampling.empty_history)
        self.history = self.placed(empty_history(slots, cfg.vocab_size))  # placed: see `placed`
        self.mask_words = mask_words(cfg.vocab_size)
        self.fingerprint = fingerprint or prefix_cache.model_fingerprint(
            self.params if self.placement is None else self.placement.unpadded(self.params, cfg))
        if self.placement is None:
            # the layers' weights as the decode plan's TPU kernels read them (32-bit word views), made
            # once here, replacing the stored bytes (every step shares the runtime, so its kernel
            # choice); unchanged for exact mode, impl "xla" and the GPU kernels. On a mesh the
            # distributed MoE (sharding.step) reads the stored bytes: kept as they are.
            self.params = kernel_params(self.graphdef, self.params, self.decode_plan)
        self.capacity = capacity_for(cfg, 1, min_capacity, self.max_seq_len)
        self.cache = self.empty(slots)
        if self.K:
            self.rings = self.placed(dspark.init_state(cfg, slots))
            self.spec_stats = {"steps": 0, "slot_steps": 0, "drafted": 0, "accepted": 0}  # speculation.summary
        self.table: list[_Slot | None] = [None] * slots
        self.row_rings = None  # the last `prefill`'s one-row DSpark rings (speculating engines)
        self.waiting: list[tuple[Request, dict]] = []
        self.done: dict[str, Result] = {}
        self._ids = itertools.count()
        self._build_steps()

    # ------------------------------------------------------------------ compiled steps
    def _build_steps(self):
        gd, rt, tail = self.graphdef, self.runtime, self.tail
        jit = functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
        # on a mesh every returned cache keeps the preset's layout (steps chain without resharding),
        # and the returned logits are replicated: the sampler's softmax / top-p sums and a
        # log-softmax over a row split on `tensor` would add the shards in another order than one
        # device does (the last bits differ), so the gather happens here, once, inside the step
        fix = (lambda c: c) if self.placement is None else self.placement.constrain

        @functools.partial(jit, donate_argnums=(2, 3, 4))
        def encoder(params, tokens, cache, enc_h, enc_pre, ids, spans=None):
            model = nnx.merge(gd, params)
            h, pre, cache = encoder_pass(model, tokens, cache, runtime=rt, engram_ids=ids, spans=spans)
            keep = lambda buf, new: jnp.concatenate([buf, new], 1)[:, -tail:]
            return fix(cache), keep(enc_h, h), keep(enc_pre, pre)

        @functools.partial(jit, donate_argnums=(3,))
        def decoder(params, enc_h, enc_pre, cache, floor, ids, vl=None):
            model = nnx.merge(gd, params)
            start = cache["length"] - tail
            logits, cache, _ = decoder_pass(model, enc_h, enc_pre, cache, start=start, floor=floor, runtime=rt,
                                            engram_ids=ids, vl=vl)
            return fix(logits[:, -1]), fix(cache)

        @functools.partial(jit, donate_argnums=(2,))
        def full(params, tokens, cache, ids, spans=None):
            logits, cache, _ = exact_prefill(nnx.merge(gd, params), tokens, cache, runtime=rt, engram_ids=ids,
                                             spans=spans)
            return fix(logits[:, -1]), fix(cache)

        @functools.partial(jit, donate_argnums=(2,))
        def replay(params, tokens, cache, ids, spans=None):
            logits, cache = replay_window(nnx.merge(gd, params), tokens, cache, runtime=rt, engram_ids=ids,
                                          spans=spans)
            return fix(logits[:, -1]), fix(cache)

        plan = self.decode_plan

        @functools.partial(jit, donate_argnums=(2,))
        def decode(params, tokens, cache, active, ids):
            logits, cache, _ = decode_step(nnx.merge(gd, params), tokens, cache, plan, engram_ids=ids, active=active)
            return fix(logits[:, -1]), fix(cache)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def insert(cache, row, slot):
            return fix(jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(a, r[0].astype(a.dtype), slot, 0),
                                    cache, row))

        self._encoder, self._decoder, self._full, self._replay = encoder, decoder, full, replay
        self._decode, self._insert = decode, insert
        if self.K:
            self._build_speculation(jit, fix)

    def _build_speculation(self, jit, fix):
        gd, rt, K, mode = self.graphdef, self.runtime, self.K, self.runtime.mode
        verify_plan = dataclasses.replace(self.decode_plan, writes="pending")

        @functools.partial(jit, donate_argnums=(2, 5))
        def full_rings(params, tokens, cache, ids, spans, rings):
            """The exact prefill piece, with its taps committed into the one-row rings."""
            model = nnx.merge(gd, params)
            start = cache["length"]
            logits, cache, aux = exact_prefill(model, tokens, cache, runtime=rt, engram_ids=ids, spans=spans, taps=True)
            n = jnp.full(start.shape, tokens.shape[1], jnp.int32)
            rings = dspark.write_rings(model, rings, dspark.main_x(model, aux["main_hidden"], mode), start, n, mode)
            return fix(logits[:, -1]), fix(cache), rings

        @jit
        def verify(params, tokens, cache, ids):
            logits, _, aux = decode_step(nnx.merge(gd, params), tokens, cache, verify_plan, engram_ids=ids, taps=True)
            return fix(logits), aux["pending"], aux["main_hidden"]

        @functools.partial(jit, donate_argnums=(4, 5))
        def commit_step(params, cache, pending, taps, rings, history, chunk, n):
            model = nnx.merge(gd, params)
            rings = dspark.write_rings(model, rings, dspark.main_x(model, taps, mode), pending["start"], n, mode)
            return fix(commit(model.cfg, cache, pending, n)), rings, speculation.count(history, chunk, n)

        plan = self.decode_plan

        @functools.partial(jit, donate_argnums=(2, 5))
        def decode_rings(params, tokens, cache, active, ids, rings):
            """The plain decode step, its taps committed into the rings: a slot's rings then hold every
            position it has cached (what `save_slot` stores for a conversation's next turn)."""
            model = nnx.merge(gd, params)
            start = cache["length"]
            logits, cache, aux = decode_step(model, tokens, cache, plan, engram_ids=ids, active=active, taps=True)
            rings = dspark.write_rings(model, rings, dspark.main_x(model, aux["main_hidden"], mode), start,
                                       active.astype(jnp.int32), mode)
            return fix(logits[:, -1]), fix(cache), rings

        tail = self.tail
        keep = lambda buf, new: jnp.concatenate([buf, new], 1)[:, -tail:]

        @functools.partial(jit, donate_argnums=(2, 3, 4, 5))
        def encoder_taps(params, tokens, cache, enc_h, enc_pre, enc_taps, ids, spans=None):
            """Graph A's piece, keeping the tail's taps of the encoder's target layers too."""
            h, pre, cache, t = encoder_pass(nnx.merge(gd, params), tokens, cache, runtime=rt, engram_ids=ids,
                                            spans=spans, taps=True)
            return fix(cache), keep(enc_h, h), keep(enc_pre, pre), keep(enc_taps, t)

        @functools.partial(jit, donate_argnums=(4, 8))
        def decoder_rings(params, enc_h, enc_pre, enc_taps, cache, floor, ids, vl, rings):
            """Graph B, its taps and the encoder's of the tail committed into the rings (the newest W
            positions: all a ring holds)."""
            model = nnx.merge(gd, params)
            start = cache["length"] - tail
            logits, cache, aux = decoder_pass(model, enc_h, enc_pre, cache, start=start, floor=floor, runtime=rt,
                                              engram_ids=ids, vl=vl, taps=True)
            taps = jnp.concatenate([enc_taps, aux["main_hidden"]], -1)
            n = jnp.full(start.shape, tail, jnp.int32)
            rings = dspark.write_rings(model, rings, dspark.main_x(model, taps, mode), start, n, mode)
            return fix(logits[:, -1]), fix(cache), rings

        self._full_rings, self._verify, self._commit = full_rings, verify, commit_step
        self._encoder_taps, self._decoder_rings = encoder_taps, decoder_rings
        self._decode_rings = decode_rings
        self._draft = jit(speculation.draft_fn(gd, mode, K))
        self._draft_sampled = jit(speculation.draft_sampled_fn(gd, mode, K))
        self._reject = jit(speculation.rejection_fn(K))
        self._position = jax.jit(lambda logits, j: logits[:, j])
        self._targets = jit(speculation.targets_fn(K))

    # ------------------------------------------------------------------ host helpers
    def _engram_ids(self, history: list[int], new: list[int]) -> np.ndarray | None:
        """The Engram hash ids of `new` after `history`: host int64 [1, len(new), n_layers, C]
        (None without Engram). `_step_params` turns them into what a step takes."""
        if self.engram is None:
            return None
        from dsv41_jax.engram.hashing import hash_ids

        layout, token_map = self.engram
        depth = layout.max_ngram_size - 1
        hist = np.asarray(history[-depth:], np.int64)[None] if history else None
        return hash_ids(layout, token_map, np.asarray(new, np.int64)[None], hist)

    def _batch_ids(self, rows: list[tuple[list[int], int]]) -> np.ndarray | None:
        """`_engram_ids` of one new token per (history, token) row, stacked: [len(rows), 1, ...]."""
        if self.engram is None:
            return None
        return np.concatenate([self._engram_ids(hist, [tok]) for hist, tok in rows], 0)

    def _step_params(self, ids: np.ndarray | None):
        """(params, Engram ids) for one compiled step over the tokens whose host hash ids are `ids`
        (`_engram_ids`, `_batch_ids`). With the tables in HBM: the engine's params and the ids on
        the device. With `engram_host`: the rows those ids read, gathered on the host and sent as
        a compact table per layer (`HostEngramTables.prefetch`, replicated where the params live),
        swapped into the params, and the ids remapped into it. The compact tables have B*T*C rows
        for a step of B rows of T tokens, so each step shape still compiles once. Every step that
        reads Engram ids gets its params here."""
        if ids is None:
            return self.params, None
        if self.host_engram is None:
            return self.params, jnp.asarray(ids.astype(np.int32))
        from sharding.engram_shard import compact_params

        compact, remapped = self.host_engram.prefetch(ids, sharding=self.replicated)
        return compact_params(self.params, compact), remapped

    def placed(self, tree):
        """`tree` committed where the params live (replicated over their mesh, if any). A fresh array
        is uncommitted and a step's output is committed, and jit compiles a program once for each,
        so a cache, buffer or stored conversation that enters a step is placed first: every piece of
        a prompt, its first included, then runs one program per shape. On an engine mesh
        (`mesh=`), caches are laid out by the preset and everything else is replicated."""
        if self.placement is not None:
            return self.placement.place(tree)
        return jax.device_put(tree, self.replicated)

    def empty(self, batch: int) -> dict:
        """An empty cache for `batch` sequences at the engine's capacity, placed (`placed`)."""
        return self.placed(empty_cache(self.cfg, batch, self.capacity))

    def _grow(self, needed: int):
        if needed <= self.capacity:
            return
        cap = capacity_for(self.cfg, needed, self.min_capacity, self.max_seq_len)
        self.cache = resize_cache(self.cfg, self.cache, cap)
        if self.placement is not None:  # keep the preset's layout at the new capacity
            self.cache = self.placed(self.cache)
        self.capacity = cap

    def _check(self, req: Request, cached: int):
        cfg = self.cfg
        prompt = np.asarray(req.prompt, np.int64)
        if prompt.ndim != 1:
            raise ValueError(f"prompt must be a flat list of token ids, got shape {prompt.shape}")
        if prompt.size and (prompt.min() < 0 or prompt.max() >= cfg.vocab_size):
            bad = int(prompt.min() if prompt.min() < 0 else prompt.max())
            raise ValueError(f"token id {bad} is out of range for vocab_size {cfg.vocab_size}")
        if cached + prompt.size == 0:
            raise ValueError("empty prompt: give at least one token (e.g. BOS)")
        if req.spans is not None:
            rows, types = np.asarray(req.spans[0]), np.asarray(req.spans[1])
            if types.shape != prompt.shape or rows.shape != prompt.shape + (cfg.dim,):
                raise ValueError(f"spans must be (rows [{prompt.size}, {cfg.dim}], token_types [{prompt.size}]) for this "
                                 f"prompt, got rows {rows.shape} and token_types {types.shape} "
                                 "(dsv41_jax.vision.merge.span_rows builds them)")
            if not cfg.vision_enabled:
                raise ValueError("this model has no vision tower (gate.bias_vl): a request with image spans needs a VL "
                                 "checkpoint")
        if req.history_spans is not None:
            rows, types = np.asarray(req.history_spans[0]), np.asarray(req.history_spans[1])
            if types.shape != (cached,) or rows.shape != (cached, cfg.dim):
                raise ValueError(f"history_spans must be (rows [{cached}, {cfg.dim}], token_types [{cached}]) for the "
                                 f"{cached} stored tokens, got rows {rows.shape} and token_types {types.shape}")
        wrong = [t for t, _ in req.sampling.logit_bias if t >= cfg.vocab_size]
        if wrong:
            raise ValueError(f"logit_bias names token id {wrong[0]}, outside the vocabulary [0, {cfg.vocab_size})")
        total = cached + prompt.size + req.sampling.max_tokens
        if total > self.max_seq_len:
            raise ValueError(f"request needs {total} positions (cached {cached} + prompt {prompt.size} + max_tokens "
                             f"{req.sampling.max_tokens}) but the engine's max_seq_len is {self.max_seq_len}")

    # ------------------------------------------------------------------ public API
    def submit(self, req: Request) -> str:
        """Queue a request; returns its id. Bad input is refused here, before any compute."""
        cached = 0
        if req.resume_from is not None:
            cached = prefix_cache.read_header(req.resume_from)["n_tokens"]
        self._check(req, cached)
        rid = req.request_id or f"req{next(self._ids)}"
        req.request_id = rid
        self.waiting.append((req, {"submitted": time.perf_counter()}))
        return rid

    def prefill(self, req: Request) -> tuple[jax.Array, dict, list[int], int]:
        """Prefill one request alone: (last-position logits [1,V], one-row cache, all tokens, cached).
        On a speculating engine, a request that may speculate also fills `self.row_rings` (its DSpark
        rings, one row: new ones, or those stored with its conversation), else leaves it None: a
        conversation stored without rings (an older file, or one written without speculation) resumes
        without speculating (its replayed window cannot rebuild them: `prefix_cache.load_rings`)."""
        cfg, W = self.cfg, self.cfg.window_size
        rings = None
        if self.K and req.speculate:
            rings = (dspark.init_state(cfg, 1) if req.resume_from is None else
                     prefix_cache.load_rings(req.resume_from, cfg, fingerprint=self.fingerprint))
            rings = None if rings is None else self.placed(rings)
        tokens: list[int] = []
        cached = 0
        logits = None
        if req.resume_from is not None:
            cache, stored = prefix_cache.load_prefix(req.resume_from, cfg, capacity=self.capacity,
                                                     fingerprint=self.fingerprint)
            cache = self.placed(cache)
            tokens = [int(t) for t in stored]
            cached = len(tokens)
            n = min(W, cached)
            params, ids = self._step_params(self._engram_ids(tokens[:-n], tokens[-n:]))
            logits, cache = self._replay(params, jnp.asarray([tokens[-n:]], jnp.int32), cache, ids,
                                         _spans(req.history_spans, cached - n, cached))
        else:
            cache = self.empty(1)
        new = [int(t) for t in req.prompt]
        if new:
            if self.exact or len(new) <= self.tail:
                done = 0
                for size in pieces(len(new), self.prefill_chunk):
                    chunk = new[done:done + size]
                    params, ids = self._step_params(self._engram_ids(tokens + new[:done], chunk))
                    args = (params, jnp.asarray([chunk], jnp.int32), cache, ids, _spans(req.spans, done, done + size))
                    if rings is not None:
                        logits, cache, rings = self._full_rings(*args, rings)
                    else:
                        logits, cache = self._full(*args)
                    done += size
            else:
                enc_h, enc_pre = self.placed((jnp.zeros((1, self.tail, cfg.hc_mult, cfg.dim), jnp.bfloat16),
                                              jnp.zeros((1, self.tail, cfg.hc_mult), jnp.float32)))
                if rings is not None:
                    enc_taps = self.placed(jnp.zeros((1, self.tail, self._encoder_tap_width()), jnp.bfloat16))
                done = 0
                for size in pieces(len(new), self.prefill_chunk):
                    chunk = new[done:done + size]
                    params, ids = self._step_params(self._engram_ids(tokens + new[:done], chunk))
                    args = (params, jnp.asarray([chunk], jnp.int32), cache, enc_h, enc_pre)
                    rest = (ids, _spans(req.spans, done, done + size))
                    if rings is not None:
                        cache, enc_h, enc_pre, enc_taps = self._encoder_taps(*args, enc_taps, *rest)
                    else:
                        cache, enc_h, enc_pre = self._encoder(*args, *rest)
                    done += size
                end = cached + len(new)
                floor = jnp.full((1,), end - self.tail, jnp.int32)
                tail_tokens = new[-self.tail:]
                tail_spans = _spans(req.spans, len(new) - self.tail, len(new))
                params, ids = self._step_params(self._engram_ids(tokens + new[:-self.tail], tail_tokens))
                vl = None if tail_spans is None else tail_spans[1] >= 0
                if rings is not None:
                    logits, cache, rings = self._decoder_rings(params, enc_h, enc_pre, enc_taps, cache, floor, ids,
                                                               vl, rings)
                else:
                    logits, cache = self._decoder(params, enc_h, enc_pre, cache, floor, ids, vl)
        self.row_rings = rings
        return logits, cache, tokens + new, cached

    def _encoder_tap_width(self) -> int:
        """Width of Graph A's taps: the drafter's target layers before the first decoder layer."""
        cfg = self.cfg
        return cfg.dim * sum(l < cfg.decoder_start for l in cfg.dspark_target_layer_ids)

    def _admit(self):
        while self.waiting and None in self.table:
            req, times = self.waiting.pop(0)
            slot = self.table.index(None)
            times["admitted"] = time.perf_counter()
            try:  # a failure here is this request's alone: the batch cache is untouched until the insert
                cached = prefix_cache.read_header(req.resume_from)["n_tokens"] if req.resume_from else 0
                self._grow(cached + len(req.prompt) + req.sampling.max_tokens)
                logits, row, tokens, cached = self.prefill(req)
                zero = jnp.zeros((1,), jnp.int32)
                first, hist = sample(logits, slot_arrays([req.sampling]), zero, history_row(self.cfg.vocab_size, tokens),
                                     zero, jnp.zeros((1,), bool), self.banned, self._masks([req]))
                self._guard(logits, 0, len(tokens))
                first = self._emit(req, 0, int(first[0]), logits, 0)
            except Exception as e:  # noqa: BLE001 - reported in the request's Result
                self._fail(req, [], e)
                continue
            times["first_token"] = time.perf_counter()
            self.cache = self._insert(self.cache, row, slot)
            self.history = self._insert(self.history, hist, slot)
            st = _Slot(req, tokens + [first], len(tokens), [first], times)
            if self.K and self.row_rings is not None:
                self.rings = self._insert(self.rings, self.row_rings, slot)
                st.rings = True
            st.prompt_tokens, st.cached_tokens = len(req.prompt), cached
            self.table[slot] = st
            self._maybe_finish(slot)

    def _fail(self, req: Request, generated: list[int], exc: Exception):
        """End one request with finish_reason "error"; the other requests go on. For failures that
        belong to one request (its prefill, its stored conversation, its token callback); a failed
        batch step still raises (its donated cache is gone: `reset`)."""
        self.done[req.request_id] = Result(req.request_id, list(generated), "error", len(req.prompt), 0, {},
                                           error=f"{type(exc).__name__}: {exc}", exception=exc)

    def _guard(self, logits, row: int, position: int):
        """With the runtime's `check_finite`: non-finite logits in `row` (the token after `position`
        tokens) raise, which fails that request alone (the caller's try)."""
        if self.runtime.check_finite:
            check_finite_logits(np.asarray(logits[row]), position)

    def _emit(self, req: Request, drawn: int, token: int, logits, row: int) -> int:
        """The token to keep (a forced one in tests), reported to `req.on_token`."""
        if drawn < len(req.forced_tokens):
            token = int(req.forced_tokens[drawn])
        if req.constraint is not None:
            req.constraint.advance(token)
        if req.on_token is not None:
            lp = None
            if req.want_logprobs:
                z = jnp.where(self.banned, -jnp.inf, logits[row].astype(jnp.float32))
                # on the host: one summation order whatever the device layout (the steps return
                # the logits replicated on a mesh, see `_build_steps`)
                lp = np.asarray(jax.nn.log_softmax(jax.device_get(z)))
            req.on_token(token, lp)
        return token

    def _masks(self, requests) -> np.ndarray:
        """Packed allowed-token rows [len(requests), W] for `sample`: all ones where a slot is
        unconstrained (or empty), the constraint's row where it has one."""
        words = np.full((len(requests), self.mask_words), -1, np.int32)
        for i, req in enumerate(requests):
            if req is None or req.constraint is None:
                continue
            req.constraint.fill(words[i])
            if not words[i].any():  # the grammar cannot go on: only a stop token may follow
                bits = words[i].view(np.uint32)
                for t in req.sampling.stop_tokens:
                    bits[t // 32] |= np.uint32(1 << (t % 32))
        return words

    def _maybe_finish(self, slot: int):
        st = self.table[slot]
        sp = st.request.sampling
        last = st.generated[-1]
        reason = "stop" if last in sp.stop_tokens else ("length" if len(st.generated) >= sp.max_tokens else None)
        if reason is None:
            return
        t = st.times
        t["finished"] = time.perf_counter()
        n_dec = len(st.generated) - 1
        timing = {"queue_s": t["admitted"] - t["submitted"], "prefill_s": t["first_token"] - t["admitted"],
                  "time_to_first_token_s": t["first_token"] - t["submitted"],
                  "decode_s": t["finished"] - t["first_token"], "total_s": t["finished"] - t["submitted"],
                  "decode_tokens_per_s": n_dec / max(t["finished"] - t["first_token"], 1e-9) if n_dec else None,
                  "prompt_tokens_per_s": st.prompt_tokens / max(t["first_token"] - t["admitted"], 1e-9)}
        if st.request.save_to is not None:
            self.save_slot(slot, st.request.save_to)
        self.done[st.request.request_id] = Result(st.request.request_id, list(st.generated), reason,
                                                  st.prompt_tokens, st.cached_tokens, timing)
        self.table[slot] = None

    def save_slot(self, slot: int, path) -> dict:
        """Store a slot's global cache and the tokens that went through the model (not the last
        sampled one), with its DSpark rings when it has them. The next turn's prompt should start
        with that token."""
        st = self.table[slot]
        row = jax.tree.map(lambda a: a[slot:slot + 1], self.cache)
        tokens = st.tokens[:st.in_cache]
        key = st.request.match_key
        key = None if key is None else list(key[:len(tokens)]) + list(tokens[len(key):])  # generated: text
        rings = jax.tree.map(lambda a: a[slot:slot + 1], self.rings) if st.rings else None
        return prefix_cache.save_prefix(path, self.cfg, row, tokens, fingerprint=self.fingerprint, match_key=key,
                                        rings=rings)

    def step(self) -> list[Result]:
        """Admit what fits, run one decode step over the active slots, evict finished. Returns
        the requests that finished during this call."""
        before = set(self.done)
        self._admit()
        active = [st is not None for st in self.table]
        spec = [self.K > 0 and st is not None and st.rings and self._can_speculate(st) for st in self.table]
        if any(spec):
            self._speculative_step(active, spec)
        elif any(active):
            last = [st.tokens[-1] if st else 0 for st in self.table]
            params, ids = self._step_params(
                self._batch_ids([(st.tokens[:-1], st.tokens[-1]) if st else ([], 0) for st in self.table]))
            args = (params, jnp.asarray(last, jnp.int32)[:, None], self.cache, jnp.asarray(active), ids)
            if self.K:  # the rings follow every cached position (`_Slot.rings`, `save_slot`)
                logits, self.cache, self.rings = self._decode_rings(*args, self.rings)
            else:
                logits, self.cache = self._decode(*args)
            # the masks are computed on the host while the device runs the decode step
            masks = self._masks([st.request if st else None for st in self.table])
            a = slot_arrays([st.request.sampling if st else None for st in self.table])
            drawn = jnp.asarray([len(st.generated) if st else 0 for st in self.table], jnp.int32)
            nxt, self.history = sample(logits, a, drawn, self.history, jnp.asarray(last, jnp.int32), jnp.asarray(active),
                                       self.banned, masks)
            nxt = np.asarray(nxt)
            for i, st in enumerate(self.table):
                if st is None:
                    continue
                try:  # the host side of one request (its logits guard, its token callback) fails it alone
                    self._guard(logits, i, len(st.tokens))
                    tok = self._emit(st.request, len(st.generated), int(nxt[i]), logits, i)
                except Exception as e:  # noqa: BLE001 - reported in the request's Result
                    self.table[i] = None
                    self._fail(st.request, st.generated, e)
                    continue
                st.in_cache += 1
                st.generated.append(tok)
                st.tokens.append(tok)
                self._maybe_finish(i)
        return [self.done[k] for k in self.done if k not in before]

    def _can_speculate(self, st: _Slot) -> bool:
        return speculation.can_speculate(st.request, len(st.generated), self.capacity - st.in_cache, self.K)

    def _speculative_step(self, active: list[bool], spec: list[bool]):
        """One step with speculation (`serving.speculation`): draft, one verify forward of K+1 tokens
        for every slot, the sampler's tokens at each position, per-slot acceptance, one commit."""
        K, B = self.K, self.slots
        last = [st.tokens[-1] if st else 0 for st in self.table]
        newest = [st.in_cache - 1 if st else -1 for st in self.table]
        masks = self._masks([st.request if st else None for st in self.table])
        a = slot_arrays([st.request.sampling if st else None for st in self.table])
        drawn = jnp.asarray([len(st.generated) if st else 0 for st in self.table], jnp.int32)
        anchor, newest = jnp.asarray(last, jnp.int32), jnp.asarray(newest, jnp.int32)
        reject = [spec[i] and self.spec_acceptance == "rejection" and st.request.sampling.temperature > 0
                  for i, st in enumerate(self.table)]
        if any(reject):
            drafts, q = self._draft_sampled(self.params, self.rings, anchor, newest, a, drawn, self.history,
                                            self.banned, masks)
        else:
            drafts = self._draft(self.params, self.rings, anchor, newest)
        drafts = np.asarray(drafts)
        chunk = np.zeros((B, K + 1), np.int32)
        chunk[:, 0] = last
        for i in range(B):
            if spec[i]:
                chunk[i, 1:] = drafts[i]
        ids = None
        if self.engram is not None:
            ids = np.concatenate([self._engram_ids(st.tokens[:-1] if st else [], [int(t) for t in chunk[i]])
                                  for i, st in enumerate(self.table)], 0)
        params, ids = self._step_params(ids)
        tokens = jnp.asarray(chunk)
        logits, pending, taps = self._verify(params, tokens, self.cache, ids)
        targets = np.asarray(self._targets(logits, a, drawn, self.history, tokens, jnp.asarray(active), self.banned,
                                           masks))
        if any(reject):
            out, n_ok = map(np.asarray, self._reject(logits, a, drawn, self.history, tokens, jnp.asarray(active),
                                                     self.banned, masks, q))
        kept = []
        for i, st in enumerate(self.table):
            if st is None:
                kept.append([])
            elif spec[i]:
                sp_ = st.request.sampling
                room = sp_.max_tokens - len(st.generated)
                if reject[i]:
                    acc = int(n_ok[i])
                    toks = speculation.cut([int(t) for t in out[i, :acc + 1]], sp_.stop_tokens, room)
                else:
                    toks, acc = speculation.accept(chunk[i, 1:], targets[i], sp_.stop_tokens, room)
                kept.append(toks)
                self.spec_stats["slot_steps"] += 1
                self.spec_stats["drafted"] += K
                self.spec_stats["accepted"] += acc  # before the stop / max_tokens cut: the drafter's figure
            else:
                kept.append([int(targets[i, 0])])
        self.spec_stats["steps"] += 1
        n = jnp.asarray([len(k) for k in kept], jnp.int32)
        self.cache, self.rings, self.history = self._commit(self.params, self.cache, pending, taps, self.rings,
                                                            self.history, tokens, n)
        for i, st in enumerate(self.table):
            if st is None:
                continue
            try:  # the host side of one request (its logits guard, its token callback) fails it alone
                for j, tok in enumerate(kept[i]):
                    at_j = self._position(logits, j)  # j traced: one program for every position (warm-up)
                    self._guard(at_j, i, len(st.tokens))
                    tok = self._emit(st.request, len(st.generated), tok, at_j, i)
                    st.in_cache += 1
                    st.generated.append(tok)
                    st.tokens.append(tok)
            except Exception as e:  # noqa: BLE001 - reported in the request's Result
                self.table[i] = None
                self._fail(st.request, st.generated, e)
                continue
            self._maybe_finish(i)

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (a client went away); its slot is free for the next
        step. Returns whether the request was found."""
        for k, (req, _) in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[k]
                return True
        for i, st in enumerate(self.table):
            if st is not None and st.request.request_id == request_id:
                self.table[i] = None
                return True
        return False

    def reset(self) -> list[str]:
        """Forget every request and start from an empty cache (after a failed step, whose donated
        cache may be gone). Returns the ids that were dropped."""
        dropped = [req.request_id for req, _ in self.waiting] + [st.request.request_id for st in self.table if st]
        self.waiting.clear()
        self.table = [None] * self.slots
        self.cache = self.empty(self.slots)
        self.history = self.placed(empty_history(self.slots, self.cfg.vocab_size))
        if self.K:
            self.rings = self.placed(dspark.init_state(self.cfg, self.slots))
        return dropped

    def occupancy(self) -> tuple[int, int]:
        """(running requests, waiting requests)."""
        return sum(st is not None for st in self.table), len(self.waiting)

    def idle(self) -> bool:
        return not self.waiting and all(st is None for st in self.table)

    def run(self, requests: list[Request]) -> list[Result]:
        """Serve a list of requests to completion; results in request order."""
        ids = [self.submit(r) for r in requests]
        while not self.idle():
            self.step()
        out = [self.done.pop(i) for i in ids]
        failed = [r for r in out if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(out)} requests failed; first: {failed[0].request_id}: "
                               f"{failed[0].error}")
        return out

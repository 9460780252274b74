"""The serving engine: continuous batching over a fixed set of slots (docs/REFERENCE.md §5).

The engine is a scheduler over pure steps. Each slot holds one sequence with its own position.
Between decode steps the scheduler admits waiting requests into free slots (their prompts are
prefilled alone, in pieces, and the one-row cache is inserted into the slot), emits each slot's
tokens, and evicts finished or cancelled ones; the device work is `serving.steps`, jitted pure
functions of (params, cache, inputs) -> (outputs, cache) built once from the settings, so the host
keeps only the slot table. Prefill (`serving.prefill`, which drives those steps for one request)
uses the CED split (Graph A over every prompt token, Graph B over the last `window + tail_slack`)
unless `exact_prefill`. Decode is `split_prefill.decode_step`
(the one layer body, `model.block`) with `Engine.decode_plan` (pool scoring, packed fast index
scoring, selected compressed rows gathered).

Where arrays live and where the Engram tables are read are strategies the engine is given
(`serving.placement`): one device or a mesh (`sharding.serving.MeshPlacement`), tables in device
memory or in host memory (`sharding.serving.HostTables`).

Compiled shapes: prefill pieces of a fixed set (`steps.piece_set`: `prefill_chunk`, a quarter of it,
... down to a 64th: 4 shapes for 512), the last piece of a prompt padded (`steps.pieces`), one
Graph B shape, one replay shape (the window, padded), one decode shape per cache capacity bucket
(`buckets`). Exact numerics pads nothing (a call's length is part of its numerics, `steps.piece_set`):
`prefill_chunk` pieces, then the remainder's powers of two, and a replay of each length below the
window.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import dspark, stack
from dsv41_jax.model.cache import cache_form
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import prefix_cache, speculation
from dsv41_jax.serving.buckets import capacity_for, empty_cache, resize_cache
from dsv41_jax.serving.placement import DeviceTables, OneDevice
from dsv41_jax.serving.prefill import prefill_request
from dsv41_jax.serving.prompt_logprobs import prompt_logprobs
from dsv41_jax.serving.request import Request, Result, check_request
from dsv41_jax.serving.sampling import (banned_mask, check_finite_logits, empty_history, history_row,
                                        mask_words, sample, slot_arrays)
from dsv41_jax.engram.hashing import hash_ids
from dsv41_jax.serving.split_prefill import check_splittable, decode_plan
from dsv41_jax.serving.steps import build_steps, pieces

__all__ = ["Engine", "EngineSettings", "Request", "Result", "pieces"]


@dataclass(frozen=True)
class EngineSettings:
    """What an engine serves with (the placement and the Engram tables are strategies, apart)."""

    slots: int = 4  # sequences decoded together
    max_seq_len: int | None = None  # prompt + completion limit per sequence; None: the config's
    min_capacity: int = 256  # the smallest cache capacity bucket
    prefill_chunk: int = 512  # prefill piece length (remainders in powers of two)
    exact_prefill: bool = False  # every layer over every prompt token (no CED split)
    tail_slack: int = 0  # Graph B runs over the last window + tail_slack prompt tokens
    runtime: Runtime = Runtime()
    banned_ids: tuple = ()  # never sampled
    # K > 0 drafts K tokens per step with the model's DSpark drafter for every slot that allows it
    # (`serving.speculation`); the prefill's taps fill the drafter's rings
    speculative: int = 0
    # at T > 0: "rejection" (rejection sampling, the target distribution) or "match" (a draft must
    # equal the target's own draw: the same tokens as without speculation)
    spec_acceptance: str = "rejection"

    def for_model(self, cfg) -> "EngineSettings":
        """These settings with max_seq_len decided for a config (None: the config's): the one place
        the serving length is derived."""
        return self if self.max_seq_len is not None else replace(self, max_seq_len=cfg.max_seq_len)

    def check(self, model) -> None:
        """Refuse settings this model cannot serve, naming the value and the fix."""
        cfg = model.cfg
        if self.speculative:
            dspark.require_dspark(model)
            if not 1 <= self.speculative <= cfg.dspark_block_size:
                raise ValueError(f"speculative={self.speculative}: the drafter proposes 1 .. {cfg.dspark_block_size} "
                                 f"tokens per block (dspark_block_size)")
        if self.spec_acceptance not in ("rejection", "match"):
            raise ValueError(f"spec_acceptance={self.spec_acceptance!r}: expected 'rejection' or 'match'")
        if not self.exact_prefill:
            check_splittable(cfg)


@dataclass
class _Slot:
    request: Request
    tokens: list[int]  # every token id of the sequence so far (cached + generated)
    in_cache: int  # how many of them went through the model
    generated: list[int]
    times: dict  # perf_counter stamps: submitted, admitted, first_token, finished
    prompt_tokens: int
    cached_tokens: int  # restored from a prefix cache
    rings: bool = False  # its DSpark rings hold every position in the cache (speculation can start)


class Engine:
    """Continuous-batching generation over `settings.slots` sequences. See the module doc."""

    def __init__(self, model, settings: EngineSettings | None = None, *, engram=None, placement=None, tables=None,
                 fingerprint: str | None = None, **options):
        """settings: an `EngineSettings`, or its fields as keywords (`options`).
        engram: (layout, token map) for a model with Engram layers (`dsv41_jax.engram.hashing`).
        placement / tables: the strategies of `serving.placement` (`strategies` builds them);
        default one device and the Engram tables in the params. fingerprint: the model's, for
        prefix-cache files (default: hashed from the params as stored)."""
        if settings is not None and options:
            raise TypeError(f"pass settings or its fields as keywords, not both (got {sorted(options)})")
        cfg = model.cfg
        s = (settings if settings is not None else EngineSettings(**options)).for_model(cfg)
        s.check(model)
        if cfg.engram_layer_ids and engram is None:
            raise ValueError("this config has Engram layers: pass engram=(layout, token_map) "
                             "(dsv41_jax.engram.hashing.EngramLayout and the token map)")
        self.settings, self.cfg, self.runtime, self.engram = s, cfg, s.runtime, engram
        self.slots, self.K, self.spec_acceptance = s.slots, s.speculative, s.spec_acceptance
        self.max_seq_len = s.max_seq_len
        self.min_capacity, self.prefill_chunk, self.exact = s.min_capacity, s.prefill_chunk, s.exact_prefill
        self.padded = s.runtime.mode != "exact"  # prefill pieces padded to a few shapes (`steps.pieces`)
        self.tail = cfg.window_size + s.tail_slack
        self.placement, self.tables = placement or OneDevice(), tables or DeviceTables()
        self.decode_plan = decode_plan(s.runtime)  # the decode step's plan, compiled into it
        model, full = self.tables.prepare(model)
        self.graphdef, self.params, stored = self.placement.load(model, self.decode_plan, host_tables=full is not None,
                                                                   taps=bool(self.K))
        self.fingerprint = fingerprint or prefix_cache.model_fingerprint(stored if full is None else full)
        # the runs of layers the steps scan, held stacked: their window rings are held stacked too
        # (`model.cache.RingStack`), so a scan reads and writes them in place
        self.ring_runs = stack.held_runs(nnx.merge(self.graphdef, self.params))
        self.replicated = self.placement.replicated  # where inputs every device reads go (`placed`)
        self.banned = jnp.asarray(banned_mask(cfg.vocab_size, s.banned_ids))
        self.mask_words = mask_words(cfg.vocab_size)
        self.capacity = capacity_for(cfg, 1, s.min_capacity, self.max_seq_len)
        self.steps = build_steps(self.graphdef, s.runtime, self.decode_plan, self.tail, self.placement.constrain, self.K,
                                 self.placement.trace)
        if self.K:
            self.spec_stats = {"steps": 0, "slot_steps": 0, "drafted": 0, "accepted": 0}  # speculation.summary
        self.table: list[_Slot | None] = [None] * s.slots
        self.row_rings = None  # the last `prefill`'s one-row DSpark rings (speculating requests)
        self.waiting: list[tuple[Request, dict]] = []
        self.done: dict[str, Result] = {}
        self._ids = itertools.count()
        self._fresh_state()

    def _fresh_state(self):
        """The batch's device state, empty: the cache, the per-slot sampling history (what the
        penalties count) and, with a drafter, its rings (None without: the steps take them as data)."""
        self.cache = self.empty(self.slots)
        self.history = self.placed(empty_history(self.slots, self.cfg.vocab_size))
        self.rings = self.placed(dspark.init_state(self.cfg, self.slots)) if self.K else None

    # ------------------------------------------------------------------ host helpers
    def engram_ids(self, history: list[int], new: list[int]) -> np.ndarray | None:
        """The Engram hash ids of `new` after `history`: host int64 [1, len(new), n_layers, C]
        (None without Engram). `step_inputs` turns them into what a step takes."""
        if self.engram is None:
            return None

        layout, token_map = self.engram
        depth = layout.max_ngram_size - 1
        hist = np.asarray(history[-depth:], np.int64)[None] if history else None
        return hash_ids(layout, token_map, np.asarray(new, np.int64)[None], hist)

    def batch_ids(self, rows: list[tuple[list[int], list[int]]]) -> np.ndarray | None:
        """`engram_ids` of each (history, new tokens) row, stacked: [len(rows), len(new), ...]."""
        if self.engram is None:
            return None
        return np.concatenate([self.engram_ids(hist, new) for hist, new in rows], 0)

    def step_inputs(self, ids: np.ndarray | None):
        """(params, Engram ids) for one compiled step over the tokens whose host hash ids are
        `ids` (`engram_ids`, `batch_ids`), as the table strategy provides them. Every step that
        reads Engram ids gets its params here."""
        if ids is None:
            return self.params, None
        return self.tables.inputs(self.params, ids, self.replicated)

    def placed(self, tree):
        """`tree` committed where the steps run (`serving.placement`: a cache by the mesh's preset,
        anything else replicated): every piece of a prompt, its first included, then runs one
        program per shape."""
        return self.placement.place(tree)

    def empty(self, batch: int) -> dict:
        """An empty cache for `batch` sequences at the engine's capacity, placed (`placed`)."""
        return self.placed(empty_cache(self.cfg, batch, self.capacity, self.runtime.kv_words(), self.ring_runs))

    def cache_form(self, cache: dict) -> dict:
        """A cache with one ring per layer and byte rows (a file's, any other driver's) in the form the
        engine keeps (`model.cache.cache_form`: the kernels' words, the scanned runs' rings stacked)."""
        return cache_form(cache, self.runtime.kv_words(), self.ring_runs)

    def grow(self, needed: int):
        """The batch cache at the capacity bucket that holds `needed` positions (never smaller)."""
        if needed <= self.capacity:
            return
        cap = capacity_for(self.cfg, needed, self.min_capacity, self.max_seq_len)
        self.cache = self.placed(resize_cache(self.cfg, self.cache, cap))  # a mesh keeps the preset's layout
        self.capacity = cap

    def _check(self, req: Request, cached: int):
        check_request(req, cached, self.cfg, self.max_seq_len)

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
        without speculating (its replayed window cannot rebuild them: `prefix_cache.load_rings`).
        The device work is `serving.prefill.prefill_request`."""
        logits, cache, tokens, cached, self.row_rings = prefill_request(self, req)
        return logits, cache, tokens, cached

    def prompt_logprobs(self, prompt: list[int]):
        """The logprobs of the prompt's own tokens (`serving.prompt_logprobs`, echo), on a cache of its
        own between steps. A method, so that serving across processes publishes it (`lockstep`)."""
        return prompt_logprobs(self, prompt)

    def encode_image(self, patches, n_vit_h: int, n_vit_w: int) -> tuple[np.ndarray, dict]:
        """(the aligner's rows [cells, dim], the span delimiters {name: [dim]}) of one image's patches, as
        numpy (`steps.image`; `vision.merge.span_rows` places them). A method, so that serving across
        processes publishes it (`lockstep`): the tower's weights live on every process's devices."""
        embeds, delimiters = self.steps.image(self.params, patches, n_vit_h, n_vit_w)
        return np.asarray(embeds), {k: np.asarray(v) for k, v in delimiters.items()}

    def _admit(self):
        while self.waiting and None in self.table:
            req, times = self.waiting.pop(0)
            slot = self.table.index(None)
            times["admitted"] = time.perf_counter()
            try:  # a failure here is this request's alone: the batch cache is untouched until the insert
                cached = prefix_cache.read_header(req.resume_from)["n_tokens"] if req.resume_from else 0
                self.grow(cached + len(req.prompt) + req.sampling.max_tokens)
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
            self.cache = self.steps.insert(self.cache, row, slot)
            self.history = self.steps.insert(self.history, hist, slot)
            st = _Slot(req, tokens + [first], len(tokens), [first], times, len(req.prompt), cached)
            if self.row_rings is not None:
                self.rings = self.steps.insert(self.rings, self.row_rings, slot)
                st.rings = True
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
                # the logits replicated on a mesh, see `serving.steps`)
                lp = np.asarray(jax.nn.log_softmax(jax.device_get(z)))
            req.on_token(token, lp)
        return token

    def _keep(self, slot: int, tokens: list[int], logits_at: Callable[[int], jax.Array]):
        """Slot `slot` keeps `tokens` (the cache already holds the positions before each): each
        guarded and emitted with its logits (`logits_at(j)`: the batch's rows for the j-th), then
        the request finishes if it is done. The host side of one request (its logits guard, its
        token callback) fails it alone."""
        st = self.table[slot]
        try:
            for j, tok in enumerate(tokens):
                at_j = logits_at(j)
                self._guard(at_j, slot, len(st.tokens))
                tok = self._emit(st.request, len(st.generated), tok, at_j, slot)
                st.in_cache += 1
                st.generated.append(tok)
                st.tokens.append(tok)
        except Exception as e:  # noqa: BLE001 - reported in the request's Result
            self.table[slot] = None
            self._fail(st.request, st.generated, e)
            return
        self._maybe_finish(slot)

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

    def _sampler_inputs(self):
        """(per-slot sampling arrays, tokens drawn so far, allowed-token masks) of the batch."""
        a = slot_arrays([st.request.sampling if st else None for st in self.table])
        drawn = jnp.asarray([len(st.generated) if st else 0 for st in self.table], jnp.int32)
        return a, drawn, self._masks([st.request if st else None for st in self.table])

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
        tokens = st.tokens[:st.in_cache]
        key = st.request.match_key
        key = None if key is None else list(key[:len(tokens)]) + list(tokens[len(key):])  # generated: text
        # the batch's cache and rings with the slot as `row`: no per-slot slicing program
        return prefix_cache.save_prefix(path, self.cfg, self.cache, tokens, fingerprint=self.fingerprint,
                                        row=slot, match_key=key, rings=self.rings if st.rings else None)

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
            self._plain_step(active)
        return [self.done[k] for k in self.done if k not in before]

    def _plain_step(self, active: list[bool]):
        """One token for every active slot (with a drafter, the rings follow every cached position:
        `_Slot.rings`, `save_slot`)."""
        last = [st.tokens[-1] if st else 0 for st in self.table]
        params, ids = self.step_inputs(self.batch_ids([(st.tokens[:-1], st.tokens[-1:]) if st else ([], [0])
                                                       for st in self.table]))
        logits, self.cache, self.rings = self.steps.decode(params, jnp.asarray(last, jnp.int32)[:, None], self.cache,
                                                           self.rings, jnp.asarray(active), ids)
        # the masks are computed on the host while the device runs the decode step
        a, drawn, masks = self._sampler_inputs()
        nxt, self.history = sample(logits, a, drawn, self.history, jnp.asarray(last, jnp.int32), jnp.asarray(active),
                                   self.banned, masks)
        nxt = np.asarray(nxt)
        for i, st in enumerate(self.table):
            if st is not None:
                self._keep(i, [int(nxt[i])], lambda j: logits)

    def _can_speculate(self, st: _Slot) -> bool:
        return speculation.can_speculate(st.request, len(st.generated), self.capacity - st.in_cache, self.K)

    def _speculative_step(self, active: list[bool], spec: list[bool]):
        """One step with speculation (`serving.speculation`): draft, one verify forward of K+1 tokens
        for every slot, the sampler's tokens at each position, per-slot acceptance, one commit."""
        d = self.steps.drafting
        last = [st.tokens[-1] if st else 0 for st in self.table]
        newest = jnp.asarray([st.in_cache - 1 if st else -1 for st in self.table], jnp.int32)
        a, drawn, masks = self._sampler_inputs()
        anchor = jnp.asarray(last, jnp.int32)
        reject = [spec[i] and self.spec_acceptance == "rejection" and st.request.sampling.temperature > 0
                  for i, st in enumerate(self.table)]
        if any(reject):
            drafts, q = d.draft_sampled(self.params, self.rings, anchor, newest, a, drawn, self.history, self.banned,
                                        masks)
        else:
            drafts = d.draft(self.params, self.rings, anchor, newest, self.banned)
        chunk = np.zeros((self.slots, self.K + 1), np.int32)
        chunk[:, 0] = last
        chunk[np.asarray(spec), 1:] = np.asarray(drafts)[np.asarray(spec)]
        params, ids = self.step_inputs(self.batch_ids([(st.tokens[:-1] if st else [], [int(t) for t in chunk[i]])
                                                       for i, st in enumerate(self.table)]))
        tokens, live = jnp.asarray(chunk), jnp.asarray(active)
        logits, pending, taps = d.verify(params, tokens, self.cache, ids)
        targets = np.asarray(d.targets(logits, a, drawn, self.history, tokens, live, self.banned, masks))
        rejected = None
        if any(reject):
            rejected = tuple(map(np.asarray, d.reject(logits, a, drawn, self.history, tokens, live, self.banned,
                                                      masks, q)))
        kept = self._accepted(chunk, targets, spec, reject, rejected)
        n = jnp.asarray([len(k) for k in kept], jnp.int32)
        self.cache, self.rings, self.history = d.commit(self.params, self.cache, pending, taps, self.rings,
                                                        self.history, tokens, n)
        for i, st in enumerate(self.table):
            if st is not None:
                self._keep(i, kept[i], lambda j: d.position(logits, j))  # j traced: one program for every j

    def _accepted(self, chunk, targets, spec, reject, rejected) -> list[list[int]]:
        """The tokens each slot keeps from a verified chunk (`speculation.accept` / `cut`), counted
        in `spec_stats`; a slot that did not speculate keeps the target after its last token."""
        kept = []
        for i, st in enumerate(self.table):
            if st is None:
                kept.append([])
            elif spec[i]:
                sp_ = st.request.sampling
                room = sp_.max_tokens - len(st.generated)
                if reject[i]:
                    out, n_ok = rejected
                    acc = int(n_ok[i])
                    toks = speculation.cut([int(t) for t in out[i, :acc + 1]], sp_.stop_tokens, room)
                else:
                    toks, acc = speculation.accept(chunk[i, 1:], targets[i], sp_.stop_tokens, room)
                kept.append(toks)
                self.spec_stats["slot_steps"] += 1
                self.spec_stats["drafted"] += self.K
                self.spec_stats["accepted"] += acc  # before the stop / max_tokens cut: the drafter's figure
            else:
                kept.append([int(targets[i, 0])])
        self.spec_stats["steps"] += 1
        return kept

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
        self._fresh_state()
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

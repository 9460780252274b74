"""Per-request sampling on device: penalties, logit bias, a grammar's token mask, then greedy or
temperature / top-k / top-p, seeded, with banned ids.

Every slot of a batch carries its own parameters, so one compiled sampler serves a mixed batch.
The random key of a draw depends only on the request's seed and how many tokens it has drawn,
so a request samples the same tokens alone or in any batch, in any slot. A slot at the neutral
values (no penalty, no bias, no mask) samples from its logits bitwise as if the adjustments did
not exist: each adjustment is selected per row with `where`, never mixed into the arithmetic.

Order of the adjustments (vLLM's, `vllm/model_executor/layers/utils.py` apply_penalties, then
logit bias, then the guided-decoding mask): repetition penalty over the prompt and the generated
tokens (HF/vLLM: a seen token's logit is divided by it when positive, multiplied when not), then
frequency and presence penalties over the generated tokens (OpenAI: logit - count * frequency -
[count > 0] * presence), then `logit_bias`, then banned ids and the grammar mask to -inf.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI's API limits logit_bias; fixed so the step never recompiles
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias is in [-100, 100]
PENALTY_RANGE = 2.0  # OpenAI: presence and frequency penalties are in [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # vLLM accepts any value > 0; beyond 10 nothing changes in practice (bounded for the range checks)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off.
    docs/REFERENCE.md §9 recommends temperature 1.0, top_p 0.95 for the released model.
    presence/frequency penalty 0, repetition penalty 1 and an empty logit_bias ((token id, bias)
    pairs) are the neutral values."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                             f"got {self.repetition_penalty}")
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are accepted")
        for t, b in bias:
            if t < 0:
                raise ValueError(f"logit_bias token id {t} is negative")
            if not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias for token {t} must be in [-100, 100], got {b}")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))

    @property
    def adjusts(self) -> bool:
        """Whether any penalty or bias changes the logits (False: the slot samples its raw logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or any(b for _, b in self.logit_bias))


def check_finite_logits(row: np.ndarray, position: int) -> None:
    """The runtime guard's host half (`Runtime.check_finite`): one logits row [V], on the host,
    for the token after `position` tokens went through the model."""
    nan, inf = int(np.isnan(row).sum()), int(np.isinf(row).sum())
    if nan or inf:
        raise FloatingPointError(f"non-finite logits for position {position} ({nan} NaN, {inf} inf of {row.size}): "
                                 "the weights or activations hold NaN/inf; load with the value check on (the default) "
                                 "to find the tensor")


def banned_mask(vocab_size: int, banned_ids) -> np.ndarray:
    """Boolean [V] mask of ids never to sample (e.g. `dsv41_jax.text.tokenizer.sentinel_ids`)."""
    mask = np.zeros((vocab_size,), bool)
    ids = np.asarray(list(banned_ids), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"banned id {int(ids.max() if ids.max() >= vocab_size else ids.min())} is outside the vocabulary "
                         f"[0, {vocab_size})")
    mask[ids] = True
    return mask


def slot_arrays(params: list[SamplingParams | None]) -> dict[str, np.ndarray]:
    """Per-slot parameter arrays for `sample` (empty slots sample greedily, results unused)."""
    p = [sp or SamplingParams() for sp in params]
    bias_ids = np.zeros((len(p), MAX_LOGIT_BIAS), np.int32)
    bias = np.zeros((len(p), MAX_LOGIT_BIAS), np.float32)
    for i, s in enumerate(p):
        for j, (t, b) in enumerate(s.logit_bias):
            bias_ids[i, j], bias[i, j] = t, b
    return {"temperature": np.array([s.temperature for s in p], np.float32),
            "top_p": np.array([s.top_p for s in p], np.float32),
            "top_k": np.array([s.top_k for s in p], np.int32),
            "seed": np.array([s.seed for s in p], np.uint32),
            "adjust": np.array([s.adjusts for s in p], bool),
            "presence": np.array([s.presence_penalty for s in p], np.float32),
            "frequency": np.array([s.frequency_penalty for s in p], np.float32),
            "repetition": np.array([s.repetition_penalty for s in p], np.float32),
            "bias_ids": bias_ids, "bias": bias}


def empty_history(batch: int, vocab_size: int) -> dict[str, jax.Array]:
    """What the penalties read, per slot: `counts` [B, V] of generated tokens and `seen` [B, V]
    (prompt or generated)."""
    return {"counts": jnp.zeros((batch, vocab_size), jnp.int32), "seen": jnp.zeros((batch, vocab_size), bool)}


def history_row(vocab_size: int, prompt) -> dict[str, np.ndarray]:
    """A new request's history as a batch of one: nothing generated, its prompt seen."""
    seen = np.zeros((1, vocab_size), bool)
    seen[0, np.asarray(list(prompt), np.int64)] = True
    return {"counts": np.zeros((1, vocab_size), np.int32), "seen": seen}


def mask_words(vocab_size: int) -> int:
    """int32 words per row of a packed token mask (llguidance's layout: bit j of word w is token 32w + j)."""
    return (vocab_size + 31) // 32


def unpack_mask(words: jax.Array, vocab_size: int) -> jax.Array:
    """Packed int32 words [B, W] -> allowed [B, V] (bool)."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)


def adjust(logits: jax.Array, params: dict, history: dict, banned: jax.Array, mask: jax.Array) -> jax.Array:
    """The logits sampling draws from (fp32 [B, V]): penalties and bias where the slot asks for
    them (module doc), banned ids and the slot's mask (packed words [B, W]; all ones = no
    constraint) at -inf."""
    z = logits.astype(jnp.float32)
    counts, seen = history["counts"], history["seen"]
    r = params["repetition"][:, None]
    p = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
    p = p - params["frequency"][:, None] * counts.astype(jnp.float32) - params["presence"][:, None] * (counts > 0)
    p = p.at[jnp.arange(z.shape[0])[:, None], params["bias_ids"]].add(params["bias"])
    z = jnp.where(params["adjust"][:, None], p, z)
    return jnp.where(banned[None] | ~unpack_mask(mask, z.shape[-1]), -jnp.inf, z)


@functools.partial(jax.jit, donate_argnums=(3,))
def sample(logits: jax.Array, params: dict, drawn, history: dict, last, active, banned, mask) -> tuple[jax.Array, dict]:
    """Next token per row of logits [B, V] and the updated history. drawn [B]: tokens this request
    drew so far; last [B]: the token appended since the previous draw, counted into the history
    first where `active` (the history holds every token before it)."""
    rows = jnp.arange(logits.shape[0])
    history = {"counts": history["counts"].at[rows, last].add(active.astype(jnp.int32)),
               "seen": history["seen"].at[rows, last].set(history["seen"][rows, last] | active)}
    logits = adjust(logits, params, history, banned, mask)
    temperature = params["temperature"]
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    order, zs = filtered(logits, params)
    pick = jax.vmap(lambda s, n, row: jax.random.categorical(draw_key(0, s, n), row))(params["seed"], drawn, zs)
    sampled = jnp.take_along_axis(order, pick[:, None], -1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy), history


def draw_key(stream: int, seed, n):
    """The key of a request's n-th draw in `stream` (0: `sample`; speculation's draft, accept and
    residual draws use streams of their own): a function of the seed and the count alone."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(stream), seed), n)


def filtered(logits: jax.Array, params: dict) -> tuple[jax.Array, jax.Array]:
    """(order, zs): adjusted logits [B, V] (`adjust`) over the temperature, sorted descending
    (`order` the token ids), with what top-k and top-p drop at -inf: softmax(zs) is the
    distribution `sample` draws from at T > 0."""
    temperature, top_p, top_k = params["temperature"], params["top_p"], params["top_k"]
    t = jnp.where(temperature > 0, temperature, 1.0)
    z = logits / t[:, None]
    order = jnp.argsort(-z, axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, -1)
    rank = jnp.arange(z.shape[-1])[None]
    zs = jnp.where((top_k[:, None] > 0) & (rank >= top_k[:, None]), -jnp.inf, zs)
    probs = jax.nn.softmax(zs, -1)
    before = jnp.cumsum(probs, -1) - probs  # mass strictly above this token
    zs = jnp.where((before < top_p[:, None]) | (rank == 0), zs, -jnp.inf)
    return order, zs


def processed(logits: jax.Array, params: dict, history: dict, last, active, banned, mask) -> tuple[jax.Array, dict]:
    """(p [B, V] fp32, history): the distribution `sample` draws from at T > 0 (penalties, bias,
    masks, temperature, top-k, top-p), in vocabulary order, with `last` counted first as `sample`
    counts it."""
    rows = jnp.arange(logits.shape[0])
    history = {"counts": history["counts"].at[rows, last].add(active.astype(jnp.int32)),
               "seen": history["seen"].at[rows, last].set(history["seen"][rows, last] | active)}
    order, zs = filtered(adjust(logits, params, history, banned, mask), params)
    p = jnp.zeros(zs.shape, jnp.float32).at[rows[:, None], order].set(jax.nn.softmax(zs, -1))
    return p, history

"""Stored FP8/FP4 weights are read in their stored format, checked on the traced
decode step of the engine (`split_prefill.decode_step` on `decode_plan`), no weights needed:

- XLA path: no routed expert is dequantized unless a row chose it. Every float value derived from
  the stacked expert weights [E, ...] comes through a gather (the active experts, or one row's
  expert), never from the whole stack: at batch 1 (the per-row path) and at a batch whose routed
  rows take the grouped path.
- pallas path (fast numerics): no whole weight is dequantized outside a kernel: the dense FP8
  linears run the FP8 block GEMM and the routed experts the grouped expert GEMM; and no stored
  weight is relaid out inside the step: each enters its kernel as the params hold it, the 32-bit
  word view `kernel_weights.kernel_params` made once at load (as `Engine` holds its params).

The tracker (`dsv41_jax.serving.weight_traffic`, which bench/decode.py --stored-weights also uses)
follows each weight parameter through the jaxpr: ops that keep the whole weight (converts, reshapes,
static slices, bit packing) carry it on; gathers (rows picked by routing), dots and kernel calls
(`pallas_call`) stop it. A floating-point value the size of the weight reached that way is a
whole-weight dequantization.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.kernel_weights import kernel_params
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import cost
from dsv41_jax.serving import split_prefill as sp
from dsv41_jax.serving import weight_traffic as wt

def _traced(cfg, batch: int, impl: str, prepared: bool = True):
    """The stored weights' uses (`weight_traffic.WeightUse`) in the engine's decode step, on the params
    as the engine holds them (`kernel_weights.kernel_params` for the plan, as `Engine` does), or as stored."""
    gd, params = cost.abstract_params(cfg)
    # the kernels as compiled on TPU (the trace needs no compilation): the FP8 GEMM kernel is on
    plan = sp.decode_plan(Runtime(mode="fast", impl=impl, interpret=False if impl == "pallas" else None))
    if prepared:
        params = jax.eval_shape(lambda p: kernel_params(gd, p, plan), params)
    tree = jax.tree_util.tree_structure(params)

    def step(leaves, tokens, cache, ids):
        p = jax.tree_util.tree_unflatten(tree, leaves)
        return sp.decode_step(nnx.merge(gd, p), tokens, cache, plan, engram_ids=ids)[0]

    return wt.trace_uses(step, params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cost.abstract_cache(cfg, batch, 64),
                         cost.engram_spec(cfg, batch, 1))


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny()  # FP8 dense linears, FP4 routed experts, as the checkpoint


@pytest.mark.parametrize("batch", [1, 160])
def test_xla_decode_dequantizes_no_inactive_expert(cfg, batch):
    # batch 160: 320 routed rows, past the grouped path's threshold (256); batch 1: the per-row path
    uses = _traced(cfg, batch, "xla")
    experts = [u for u in uses if "['experts']" in u.name]
    assert len(experts) == 3 * cfg.n_layers
    whole = [(u.name, u.dequantized[:1]) for u in experts if u.dequantized]
    assert whole == [], f"whole expert stacks dequantized: {whole[:4]}"
    assert all(u.gathered_bytes > 0 for u in experts)  # the active experts' rows are read
    # the tracker sees the dense FP8 linears' whole-weight dequantization (it cannot pass vacuously)
    assert any(u.dequantized for u in uses if "['experts']" not in u.name)


def test_pallas_decode_dequantizes_no_whole_weight_outside_a_kernel(cfg):
    uses = _traced(cfg, 1, "pallas")
    assert len(uses) > 10
    whole = [(u.name, u.dequantized[:1]) for u in uses if u.dequantized]
    assert whole == [], f"whole weights dequantized outside a kernel: {whole[:4]}"
    linears = [u for u in uses if "['experts']" not in u.name and "embed" not in u.name]
    assert linears and all(u.kernels == {"fp8_block_gemm_tpu"} for u in linears), linears[:2]
    assert all(u.kernels == {"grouped_fp4_gemm_tpu"} for u in uses if "['experts']" in u.name)


def test_pallas_decode_relays_out_no_stored_weight(cfg):
    """On the params the engine holds (`kernel_params`' word views) every stored weight enters its kernel
    as it is: no copy of a whole weight is made inside the decode step. On the stored bytes, the
    kernels' wrappers relayout every weight on every call (what the word views made once remove):
    the tracker sees that, so the first assertion cannot pass vacuously."""
    uses = _traced(cfg, 1, "pallas")
    assert uses and all(u.kernels for u in uses if "embed" not in u.name)
    relaid = [(u.name, u.relayout_bytes) for u in uses if u.relayout_bytes]
    assert relaid == [], f"stored weights relaid out inside the decode step: {relaid[:4]}"
    stored = _traced(cfg, 1, "pallas", prepared=False)
    assert all(u.relayout_bytes == u.stored_bytes for u in stored if u.kernels)  # one whole copy per weight
    # the views hold the stored bytes (FP8: padded to K blocks of 32, none here): the footprint is unchanged
    assert sum(u.stored_bytes for u in uses) == sum(u.stored_bytes for u in stored)


def _leaves(params) -> dict:
    return {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_kernel_params_replace_the_stored_bytes_with_word_views(tiny_every_role):
    """`kernel_params` (what `Engine` holds for its plan): the layers' FP4 expert stacks and scales and,
    with the FP8 kernel on, their FP8 linears become int32 word views of the same bytes; nothing else
    changes, the caller's params are untouched, and any plan that reads the bytes gets them back as
    they are. The kernels give the same results on either, bit for bit."""
    from dsv41_jax.model.block import Plan, fp8_linears
    from dsv41_jax.numerics import gemm

    cfg, gd, params = tiny_every_role
    before = _leaves(params)
    plan = Plan.resolve(Runtime(mode="fast", impl="pallas", fp8_kernel=True))  # interpreted TPU kernels on CPU
    after = _leaves(kernel_params(gd, params, plan))
    assert after.keys() == before.keys()
    changed = {k for k in before if after[k] is not before[k]}
    assert changed and all(after[k].dtype == jnp.int32 for k in changed)
    assert all(k.startswith("['layers']") for k in changed)
    fp8 = {k for k, a in before.items() if a.dtype == jnp.float8_e4m3fn and k.startswith("['layers']")}
    experts = {k for k in before if "['experts']" in k}
    assert changed == fp8 | experts
    for k in changed:  # the same bytes (FP8 K is whole 32-blocks here); an FP4 scale row is padded to whole words
        a = before[k]
        want = a.nbytes if "scale" not in k else int(np.prod(a.shape[:-1])) * -(-a.shape[-1] // 4) * 4
        assert after[k].nbytes == want, k
    assert all(_leaves(params)[k] is before[k] for k in before)  # pure: the input keeps its bytes
    for rt in (Runtime(mode="exact", impl="pallas"), Runtime(mode="fast", impl="xla")):
        assert kernel_params(gd, params, Plan.resolve(rt)) is params
    # without the FP8 kernel (the CPU default): only the experts
    only_experts = _leaves(kernel_params(gd, params, Plan.resolve(Runtime(mode="fast", impl="pallas"))))
    assert {k for k in before if only_experts[k] is not before[k]} == experts

    # the same numbers from the views: one layer's MoE (grouped expert kernel) and an FP8 linear (FP8 kernel)
    stored, words = nnx.merge(gd, params).layers[0], nnx.merge(gd, kernel_params(gd, params, plan)).layers[0]
    x = jax.random.normal(jax.random.key(0), (2, 3, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    with fp8_linears(plan):
        ys = [(b.ffn(x, "fast", "pallas", True)[0], b.attn.wq_a(x, "fast")) for b in (stored, words)]
    for a, b in zip(*ys):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="word view"):  # a view outside its plan is refused, not misread
        words.attn.wq_a(x, "fast")
    assert gemm.linear(x, stored.attn.wq_a.weight[...], stored.attn.wq_a.scale[...], kind="fp8").shape[-1] > 0


def test_engine_holds_the_word_views_of_its_plan(tiny_every_role):
    """The engine prepares its params once for its plan (`kernel_params`); its fingerprint is the
    stored weights' (prefix-cache files stay valid across impls)."""
    from dsv41_jax.serving.engine import Engine

    cfg, gd, params = tiny_every_role
    engines = {impl: Engine(nnx.merge(gd, params), slots=1, exact_prefill=True, min_capacity=16,
                            runtime=Runtime(mode="fast", impl=impl)) for impl in ("xla", "pallas")}
    experts = lambda e: [a for k, a in _leaves(e.params).items() if "['experts']" in k]  # noqa: E731
    assert all(a.dtype == jnp.int32 for a in experts(engines["pallas"]))
    assert not any(a.dtype == jnp.int32 for a in experts(engines["xla"]))
    assert engines["pallas"].fingerprint == engines["xla"].fingerprint


@pytest.mark.slow
def test_engine_on_word_views_equals_the_stored_bytes():
    """An engine on the kernels (fast, impl "pallas", FP8 kernel on, interpreted) generates the same
    tokens and decode logits, bit for bit, from the word views it prepared as from the stored bytes
    (the kernels' wrappers then make the views per call): split prefill (the CED projection's FP8
    linears included), decode. Slow: the interpreted kernels compile twice."""
    from dsv41_jax.model.transformer import Transformer
    from dsv41_jax.serving import sampling
    from dsv41_jax.serving.engine import Engine, Request

    cfg = ModelConfig.tiny(engram_layer_ids=(), max_seq_len=64, max_batch_size=2)
    model = Transformer(cfg, rngs=3)
    stored = nnx.split(model)[1]
    eng = Engine(model, slots=1, min_capacity=64, runtime=Runtime(mode="fast", impl="pallas", fp8_kernel=True))
    words = eng.params
    assert any(a.dtype == jnp.int32 for a in jax.tree.leaves(words))
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 12)]
    greedy = sampling.SamplingParams(max_tokens=4, temperature=0.0)
    got = {}
    for name, params in (("words", words), ("stored", stored)):
        eng.params = params
        rows = []
        tokens = eng.run([Request(prompt, greedy, want_logprobs=True,
                                  on_token=lambda t, lp: rows.append(np.asarray(lp)))])[0].tokens
        got[name] = (tokens, np.stack(rows))
    assert got["words"][0] == got["stored"][0] and len(got["words"][0]) == 4
    np.testing.assert_array_equal(got["words"][1], got["stored"][1])  # the log-softmax rows, bit for bit

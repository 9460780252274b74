"""The vision path: golden tower outputs bit for bit, checkpoint I/O of every VL tensor, and the
prompt merge semantics (span rows before the hc expansion, bias_vl routing, no Engram on spans,
chunked prefill through an image equal to one prefill)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.checkpoint import load_checkpoint, save_hf_checkpoint
from dsv41_jax.checkpoint.synthetic import model_from_params, random_params
from dsv41_jax.checkpoint.weights import to_reference_state_dict
from dsv41_jax.model.param_names import flat_params, is_vision_name
from dsv41_jax.model.transformer import engram_table_rows, init_cache, make_step
from dsv41_jax.runtime import Runtime
from dsv41_jax.vision.merge import ImageInput, make_image_encoder, span_rows, span_types, TEXT


@pytest.fixture(scope="module")
def vl():
    """(cfg, model, graphdef, params) of a tiny VL model with Engram, random release-format weights."""
    cfg = ModelConfig.tiny_vision(max_seq_len=64)
    model = model_from_params(cfg, random_params(cfg, seed=3))
    graphdef, params = nnx.split(model)
    return cfg, model, graphdef, params


def _prompt(cfg, model, graphdef, params, rng):
    """8 text tokens, a 6 x 7 patch image (2 x 3 cells), 6 text tokens: tokens, types, span rows."""
    n_h, n_w = 6, 7
    types = np.concatenate([np.full(8, TEXT), span_types(2, 3), np.full(6, TEXT)])
    tokens = rng.integers(0, 500, types.shape[0])
    tokens[types >= 0] = cfg.image_token_id
    patches = rng.uniform(-1, 1, (n_h * n_w, 3, 4, 4)).astype(jnp.bfloat16)
    _, emb = make_image_encoder(graphdef, Runtime(mode="fast"))(params, jnp.asarray(patches), n_h, n_w)
    rows = span_rows(model, types, [ImageInput(8, patches, n_h, n_w)], [np.asarray(emb)])
    return tokens, types, rows, np.asarray(emb)


def test_golden_tower_outputs_are_bit_exact(golden_root):
    from dsv41_jax.golden import data as golden_data
    from dsv41_jax.golden.check import CaseRunner, check_vision

    gc = next((g for g in golden_data.discover(golden_root) if g.name == "vision_fp8"), None)
    if gc is None:
        pytest.skip("no vision_fp8 golden folder")
    with jax.enable_x64(True):
        runner = CaseRunner(gc)
        case = next(c for c in gc.cases if c["name"] == "vl_prefill_L30_i8x6x7")  # traced: every ViT block
        entry, _ = check_vision(runner, case, gc.case_tensors(case))
    assert entry.passed, entry.detail
    assert entry.detail.count("==") == 6  # patch_embed, 2 blocks, vit_output, vision_embeds, merged_embeddings


@pytest.mark.slow
def test_golden_check_vision_folder_passes(golden_root):
    from dsv41_jax.golden.check import run_all

    entries = run_all(golden_root, only=["vision_fp8"])
    names = {e.name for e in entries}
    assert {f"vision_fp8/{c}[vision]" for c in ("vl_prefill_L30_i8x6x7", "vl_prefill_L40_i3x6x7_i20x3x4",
                                                 "vl_decode_P30_S10_i8x6x7", "vl_prefill_L16_i0x9x9")} <= names
    assert all(e.passed for e in entries), [(e.name, e.detail) for e in entries if not e.passed]


def test_checkpoint_round_trip_carries_every_vl_tensor(vl, tmp_path):
    cfg, model, _, _ = vl
    save_hf_checkpoint(model, tmp_path / "ckpt", narrow="strict", max_shard_bytes=256 << 10)
    cfg2, loaded, report = load_checkpoint(tmp_path / "ckpt", progress=False)
    same_runtime = dict(max_seq_len=cfg.max_seq_len, max_batch_size=cfg.max_batch_size)  # not stored in config.json
    assert cfg2.replace(**same_runtime) == cfg and not report.skipped
    want, got = to_reference_state_dict(model), to_reference_state_dict(loaded)
    vl_names = sorted(n for n in want if is_vision_name(n))
    assert len([n for n in vl_names if n.endswith("gate.bias_vl")]) == cfg.n_layers
    assert {"image_start", "image_end", "image_newline", "aligner.w1.weight", "aligner.w2.bias",
            "vision.patch_embed.proj.weight", "vision.norm.weight", "vision.blocks.1.attn.wqkv.bias"} <= set(vl_names)
    assert sorted(got) == sorted(want)
    for n in want:
        np.testing.assert_array_equal(np.asarray(got[n]).view(np.uint8), np.asarray(want[n]).view(np.uint8), err_msg=n)

    # --language-model-only: the VL tensors stay on disk, listed as skipped; the model is text only
    cfg3, text_only, report = load_checkpoint(tmp_path / "ckpt", progress=False, language_model_only=True)
    assert cfg3.replace(**same_runtime) == cfg.language_model_only() and text_only.vision is None
    assert sorted(report.skipped) == vl_names
    assert not any(is_vision_name(n) for n in to_reference_state_dict(text_only))


def test_orbax_conversion_carries_the_tower(vl, tmp_path):
    from dsv41_jax.checkpoint import load
    from dsv41_jax.checkpoint.orbax_io import save_params

    cfg, model, _, _ = vl
    save_params(tmp_path / "orbax", model, cfg)
    cfg2, loaded, _ = load(tmp_path / "orbax")
    assert cfg2.replace(max_seq_len=cfg.max_seq_len, max_batch_size=cfg.max_batch_size) == cfg
    a, b = flat_params(model), flat_params(loaded)
    vision_paths = [p for p in a if p[0] in ("vision", "aligner", "image_start", "image_end", "image_newline")
                    or p[-1] == "bias_vl"]
    assert len(vision_paths) > 20
    for p in vision_paths:
        np.testing.assert_array_equal(np.asarray(b[p].get_value()), np.asarray(a[p].get_value()))


@pytest.mark.slow  # a collecting compilation of the backbone with Engram (~1-2 min on 2 shared cores)
def test_spans_replace_embeddings_route_with_bias_vl_and_skip_engram(vl):
    cfg, model, graphdef, params = vl
    tokens, types, rows, emb = _prompt(cfg, model, graphdef, params, np.random.default_rng(0))
    T = tokens.shape[0]
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    rows_per_table = engram_table_rows(cfg)
    rng = np.random.default_rng(1)
    eids = np.stack([rng.integers(0, r, (1, T, n_cols)) for r in rows_per_table], 2).astype(np.int32)
    step = make_step(graphdef, Runtime(mode="fast"), collect=True)
    spans = (jnp.asarray(rows[None]), jnp.asarray(types[None], jnp.int32))
    _, _, aux = step(params, jnp.asarray(tokens[None], jnp.int32), init_cache(cfg, 1), jnp.asarray(eids), None, None, spans)
    tr = jax.tree.map(np.asarray, aux["trace"])
    span = types >= 0
    # layer 0's input: every hc copy holds the span row at span positions, the token embedding elsewhere
    block0 = tr["layer0.block_input"][0].astype(np.float32)
    embed = np.asarray(model.embed[...]).astype(np.float32)[tokens]
    np.testing.assert_array_equal(block0[span], np.broadcast_to(rows.astype(np.float32)[span][:, None], block0[span].shape))
    np.testing.assert_array_equal(block0[~span][:, 0], embed[~span])
    np.testing.assert_array_equal(rows[types == 1].astype(np.float32), emb.astype(np.float32))
    for l in range(cfg.n_layers):
        gate = model.layers[l].ffn.gate
        scores = tr[f"layer{l}.gate_scores"][0]
        chosen = np.sort(tr[f"layer{l}.gate_indices"][0], -1)
        for bias, where in ((np.asarray(gate.bias_vl[...]), span), (np.asarray(gate.bias[...]), ~span)):
            want = np.sort(np.argsort(-(scores + bias), -1, kind="stable")[:, :cfg.n_activated_experts], -1)
            np.testing.assert_array_equal(chosen[where], want[where], err_msg=f"layer {l}")
    for l in cfg.engram_layer_ids:
        g = tr[f"engram.{l}.gate"][0]
        assert np.all(g[span] == 0) and np.all(g[~span] > 0)  # a zero gate leaves the stream as it was


@pytest.mark.slow  # two more compilations of the backbone (~50 s on 2 cores)
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_chunked_prefill_through_an_image_equals_one_prefill(vl, mode):
    """The reference refuses images outside the first chunk; here the span rows travel with their
    positions, so any schedule computes the same thing: the same experts everywhere, and logits
    bit for bit in exact mode (fast mode: within fp32 accumulation order, as tests/README.md says)."""
    cfg, model, graphdef, params = vl
    tokens, types, rows, _ = _prompt(cfg, model, graphdef, params, np.random.default_rng(2))
    cfg_e = cfg.replace(engram_layer_ids=())
    model_e = model_from_params(cfg_e, {p: np.asarray(v.get_value()) for p, v in flat_params(model).items()
                                        if p[2:3] != ("engram",)})
    gdef, prm = nnx.split(model_e)
    with jax.enable_x64(mode == "exact"):
        step = make_step(gdef, Runtime(mode=mode))

        def run(chunks):
            cache, outs, experts, s = init_cache(cfg_e, 1), [], [], 0
            for n in chunks:
                sp = (jnp.asarray(rows[None, s:s + n]), jnp.asarray(types[None, s:s + n], jnp.int32))
                logits, cache, aux = step(prm, jnp.asarray(tokens[None, s:s + n], jnp.int32), cache, None, None, None, sp)
                outs.append(np.asarray(logits[0]))
                experts.append(np.stack([np.asarray(aux["experts"][l][0]) for l in range(cfg_e.n_layers)]))
                s += n
            return np.concatenate(outs), np.concatenate(experts, 1)

        whole, e_whole = run([tokens.shape[0]])
        split, e_split = run([12, 12])  # the split falls inside the image span (positions 8..17)
    np.testing.assert_array_equal(e_split, e_whole)
    if mode == "exact":
        np.testing.assert_array_equal(split, whole)
    else:
        np.testing.assert_allclose(split, whole, rtol=1e-4, atol=1e-4)


def test_sharding_rules_name_and_the_plan_counts_the_tower(vl):
    from sharding.plan import weight_bytes
    from sharding.rules import VISION, param_bucket, param_logical_axes

    cfg, model, _, _ = vl
    vision_bytes = 0
    for path, var in flat_params(model).items():
        param_logical_axes(path, var.ndim)  # raises for a parameter the tables do not describe
        if param_bucket(path) == VISION:
            vision_bytes += var.size * var.dtype.itemsize
    assert vision_bytes > 0
    w = weight_bytes(cfg, {"data": 1, "expert": 1, "tensor": 1}, "inference")
    assert w["global"][VISION] == vision_bytes == w["per_device"][VISION]

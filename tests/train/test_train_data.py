"""Training data and the pieces around the train step: tokenizer fallback, chat loss masks,
packing with document alignment, per-document Engram hashing, the indexer KL terms, LoRA,
the optimizer groups, mesh specs."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.text import special_tokens as st
from dsv41_jax.train import data as D
from dsv41_jax.train import forward as F
from dsv41_jax.train import lora as L
from dsv41_jax.train import mesh as M
from dsv41_jax.train import optim as O

from tests.support.train_fixtures import TOKENIZER, micro_config


def test_byte_tokenizer_round_trips_text_and_specials():
    from dsv41_jax.text.pieces import caller, encoder

    text = f"{st.USER}héllo\n{st.ASSISTANT}{st.THINK_END}wörld{st.EOS}"
    ids = TOKENIZER.encode(text, split_special_tokens=True)  # documents: the marker spellings stay bytes
    assert TOKENIZER.decode(ids) == text and min(ids) >= TOKENIZER.n_special
    assert TOKENIZER.encode(text) == [TOKENIZER.SPECIALS.index(st.USER), *TOKENIZER.encode("héllo\n"),
                                      TOKENIZER.SPECIALS.index(st.ASSISTANT), TOKENIZER.SPECIALS.index(st.THINK_END),
                                      *TOKENIZER.encode("wörld"), TOKENIZER.SPECIALS.index(st.EOS)]
    ids = TOKENIZER.encode_pieces([encoder(st.USER), caller("héllo\n"), encoder(st.ASSISTANT + st.THINK_END),
                                   caller(f"wörld{st.EOS}"), encoder(st.EOS)])
    assert TOKENIZER.decode(ids) == text + st.EOS
    assert ids[0] == TOKENIZER.SPECIALS.index(st.USER)
    assert ids.count(TOKENIZER.eos_id) == 1  # the one the encoder wrote
    assert max(ids) < TOKENIZER.vocab_size == 264


def test_chat_document_masks_only_assistant_replies():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
    doc = D.chat_document(TOKENIZER, messages)
    trained = TOKENIZER.decode(doc.ids[doc.target_mask])
    assert trained == f"yo{st.EOS}ok{st.EOS}"
    assert TOKENIZER.decode(doc.ids[:3]).startswith(st.BOS)


def test_a_message_mask_moves_it_in_or_out_of_the_loss_and_never_changes_the_prompt():
    """`mask` (DeepSeek's encoder carries it per message, renders nothing): true masks a reply out
    of the loss, false trains on any message; the ids are those without the field."""
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"},
             {"role": "assistant", "content": "ok"}]
    marked = [dict(plain[0], mask=False), plain[1], dict(plain[2], mask=True), dict(plain[3], mask=False), plain[4]]
    ref, doc = D.chat_document(TOKENIZER, plain), D.chat_document(TOKENIZER, marked)
    assert doc.ids.tolist() == ref.ids.tolist()
    trained = TOKENIZER.decode(doc.ids[doc.target_mask])
    # the system turn (BOS stays context), the second user turn with its assistant marker, the last reply
    assert trained == f"{st.SYSTEM}be brief{st.USER}more{st.ASSISTANT}</think>ok{st.EOS}", trained
    with pytest.raises(ValueError, match=r"messages\[1\]: mask must be true or false \(or 1 or 0\), got 'yes'"):
        D.chat_document(TOKENIZER, [plain[0], dict(plain[1], mask="yes")])


def test_read_documents_reads_text_jsonl_and_chat(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "json text"}) + "\n\n" +
                                      json.dumps({"messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"}]}) + "\n")
    docs = D.read_documents([tmp_path], TOKENIZER)
    texts = [TOKENIZER.decode(d.ids, skip_special=True) for d in docs]
    assert "plain text" in texts and "json text" in texts and len(docs) == 3
    assert docs[2].target_mask.sum() == 2  # "a" + EOS
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="text.*messages"):
        D.read_documents([tmp_path / "bad.jsonl"], TOKENIZER)
    with pytest.raises(FileNotFoundError):
        D.read_documents([tmp_path / "missing.txt"], TOKENIZER)


def test_pack_aligns_documents_and_masks_boundaries():
    docs = [D.text_document(TOKENIZER, "x" * n) for n in (5, 9, 3, 40)]
    rows = D.pack(docs, 16, 4, TOKENIZER.pad_id, seed=0)
    toks, pos, tgt, lm, valid = (rows[k] for k in ("tokens", "positions", "targets", "loss_mask", "valid"))
    assert toks.shape[1] == 16
    starts = np.argwhere(pos == 0)
    for r, c in starts:
        if valid[r, c]:
            assert c % 4 == 0  # every document starts on the alignment grid
    # inputs and targets are the document shifted by one, and padding trains nothing
    assert np.all(lm[valid == 0] == 0) and np.all(toks[valid == 0] == TOKENIZER.pad_id)
    inner = (valid[:, 1:] == 1) & (pos[:, 1:] > 0)
    assert np.array_equal(tgt[:, :-1][inner], toks[:, 1:][inner])
    n_trained = sum(len(d.ids) - 1 for d in docs)
    assert int(lm.sum()) == n_trained  # a 40-byte document is split into row-sized pieces, nothing lost


def test_pack_rejects_misaligned_rows():
    with pytest.raises(ValueError, match="multiple of the document alignment"):
        D.pack([D.text_document(TOKENIZER, "abc")], 30, 4, TOKENIZER.pad_id)


def test_alignment_covers_ratios_and_candidate_blocks():
    cfg = micro_config(32)
    assert D.alignment(cfg) == 4  # lcm(2, 1 * candidate_block_size 4)


def test_engram_ids_are_hashed_per_document():
    """A document's Engram rows do not depend on what precedes it in the packed row."""
    from dsv41_jax.engram.hashing import hash_ids

    cfg = micro_config(32)
    layout, token_map = D.engram_setup(cfg, TOKENIZER)
    a, b = TOKENIZER.encode("first doc"), TOKENIZER.encode("second")
    tokens = np.asarray([a + b], np.int32)
    positions = np.asarray([list(range(len(a))) + list(range(len(b)))], np.int32)
    ids = D.engram_ids(layout, token_map, tokens, positions)
    alone = hash_ids(layout, token_map, np.asarray([b]))
    np.testing.assert_array_equal(ids[0, len(a):], alone[0])
    assert not np.array_equal(hash_ids(layout, token_map, tokens)[0, len(a):], alone[0])


def test_batches_are_a_function_of_the_index():
    rows = D.pack([D.text_document(TOKENIZER, "y" * k) for k in range(3, 60)], 16, 4, TOKENIZER.pad_id)
    data = D.PackedData(rows, 4, seed=3)
    again = D.PackedData(rows, 4, seed=3)
    for i in (0, 5, data.batches_per_epoch + 1):
        for k in rows:
            np.testing.assert_array_equal(data.batch(i)[k], again.batch(i)[k])
    assert not np.array_equal(data.batch(0)["tokens"], data.batch(data.batches_per_epoch)["tokens"])


# ------------------------------------------------------------------------ forward helpers
def test_window_and_group_visibility_are_document_relative():
    # one row: document A = positions 0..7, document B = 8..15 (restarting at 0)
    positions = jnp.asarray([list(range(8)) + list(range(8))], jnp.int32)
    seg = jnp.arange(16)[None] - positions
    slots = F._window_slots(16, 4, seg, None, False)
    assert np.all(np.asarray(slots[0, 9]) == [-1, -1, 8, 9])  # no slot of document A
    assert np.all(np.asarray(slots[0, 6]) == [3, 4, 5, 6])
    trunc = F._window_slots(16, 4, jnp.zeros((1, 16), jnp.int32), jnp.asarray([5]), True)
    assert np.all(np.asarray(trunc[0, 6]) == [-1, -1, 5, 6])  # split prefill: nothing before s = 5
    assert np.all(np.asarray(trunc[0, 4]) == [1, 2, 3, 4])  # queries before s are untouched
    legal = np.asarray(F._legal_groups(positions, seg, 2)[0])  # [T, G]
    assert legal[7].tolist() == [True] * 4 + [False] * 4  # t=7 sees A's four groups
    assert legal[9].tolist() == [False] * 4 + [True] + [False] * 3  # t=9 sees only B's first group
    # a group straddling two documents is invisible to everyone
    odd = jnp.asarray([list(range(5)) + list(range(11))], jnp.int32)
    legal_odd = np.asarray(F._legal_groups(odd, jnp.arange(16)[None] - odd, 2)[0])
    assert not legal_odd[:, 2].any()  # group 2 = tokens 4 (doc A) and 5 (doc B)


def test_attention_target_and_kl_match_float64_oracle():
    rng = np.random.default_rng(0)
    B, P, H, D_, G, W, T = 1, 3, 2, 8, 5, 3, 6
    q = rng.normal(size=(B, P, H, D_)).astype(np.float32)
    win = rng.normal(size=(B, T, D_)).astype(np.float32)
    comp = rng.normal(size=(B, G, D_)).astype(np.float32)
    win_idx = np.asarray([[[0, 1, 2], [-1, 3, 4], [-1, -1, 5]]], np.int32)
    allowed = np.asarray([[[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]], bool)
    sink = rng.normal(size=(H,)).astype(np.float32)
    scale = D_ ** -0.5
    target = np.asarray(F._attention_target(jnp.asarray(q), jnp.asarray(win), jnp.asarray(win_idx), jnp.asarray(comp),
                                            jnp.asarray(allowed), jnp.asarray(sink), scale))
    for p in range(P):
        mass = np.zeros(G)
        for h in range(H):
            sc = [float(q[0, p, h] @ comp[0, g]) * scale for g in range(G) if allowed[0, p, g]]
            sw = [float(q[0, p, h] @ win[0, i]) * scale for i in win_idx[0, p] if i >= 0]
            z = np.sum(np.exp(sc)) + np.sum(np.exp(sw)) + np.exp(sink[h])
            gi = [g for g in range(G) if allowed[0, p, g]]
            for g, s in zip(gi, sc):
                mass[g] += np.exp(s) / z
        want = mass / mass.sum() if mass.sum() > 0 else mass
        np.testing.assert_allclose(target[0, p], want, rtol=1e-5, atol=1e-7)
    scores = rng.normal(size=(B, P, G)).astype(np.float32)
    kl_sum, count = F._kl(jnp.asarray(target), jnp.asarray(scores), jnp.asarray(allowed))
    want = 0.0
    for p in (0, 2):
        idx = allowed[0, p]
        logq = scores[0, p, idx] - np.log(np.sum(np.exp(scores[0, p, idx].astype(np.float64))))
        t = target[0, p, idx]
        want += np.sum(np.where(t > 0, t * (np.log(np.where(t > 0, t, 1)) - logq), 0))
    assert float(count) == 2
    np.testing.assert_allclose(float(kl_sum), want, rtol=1e-5)
    g = jax.grad(lambda s: F._kl(jnp.asarray(target), s, jnp.asarray(allowed))[0])(jnp.asarray(scores))
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~allowed] == 0)


# ------------------------------------------------------------------------ LoRA, optimizer, mesh
def test_lora_targets_and_merge():
    shapes = {"layers.0.attn.wq_a.weight": jax.ShapeDtypeStruct((6, 4), jnp.float32),
              "layers.0.ffn.experts.w1": jax.ShapeDtypeStruct((3, 6, 4), jnp.float32),
              "layers.0.attn.indexer.wq_b.weight": jax.ShapeDtypeStruct((6, 4), jnp.float32),
              "embed": jax.ShapeDtypeStruct((10, 4), jnp.float32)}
    assert L.lora_targets(shapes) == ["layers.0.attn.wq_a.weight", "layers.0.ffn.experts.w1"]
    lora = L.init_lora(shapes, 2)
    assert lora["layers.0.ffn.experts.w1.lora_a"].shape == (3, 2, 4)
    master = {k: jnp.ones(v.shape) for k, v in shapes.items()}
    merged = L.apply_lora(master, lora, 1.0)
    np.testing.assert_array_equal(np.asarray(merged["layers.0.attn.wq_a.weight"]), 1.0)  # B starts at 0
    lora["layers.0.ffn.experts.w1.lora_b"] = jnp.ones((3, 6, 2))
    merged = L.apply_lora(master, lora, 0.5)
    a = np.asarray(lora["layers.0.ffn.experts.w1.lora_a"])
    want = 1.0 + 0.5 * np.einsum("eor,eri->eoi", np.ones((3, 6, 2)), a)
    np.testing.assert_allclose(np.asarray(merged["layers.0.ffn.experts.w1"]), want, rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_groups_and_schedule(name):
    params = {"embed": jnp.ones((8, 4)), "layers.1.engram.embed": jnp.ones((16, 4)),
              "layers.0.attn_norm.weight": jnp.ones(4), "layers.0.attn.wq_a.weight": jnp.ones((4, 4)),
              "layers.0.ffn.experts.w1": jnp.ones((2, 4, 4))}
    c = O.OptimConfig(optimizer=name, lr=1e-2, warmup_steps=2, total_steps=10, lr_engram_mult=10.0, weight_decay=0.0)
    labels = O.labels(params, name)
    assert labels["layers.1.engram.embed"] == "engram" and labels["layers.0.attn_norm.weight"] == "no_decay"
    assert labels["layers.0.ffn.experts.w1"] == ("muon" if name == "muon" else "default")
    tx = O.make_optimizer(c, params)
    state = tx.init(params)
    grads = {k: jnp.full(v.shape, 0.1) for k, v in params.items()}
    update = jax.jit(tx.update)
    for _ in range(2):  # step 0 has lr 0 (warmup starts at 0)
        updates, state = update(grads, state, params)
    step_embed = float(jnp.abs(updates["embed"]).max())
    step_engram = float(jnp.abs(updates["layers.1.engram.embed"]).max())
    assert step_embed > 0 and abs(step_engram / step_embed - 10.0) < 1e-3
    assert float(O.schedule(c)(0)) == 0.0 and abs(float(O.schedule(c)(2)) - 1e-2) < 1e-9


def test_mesh_specs():
    assert M.make_mesh("data=2,tensor=4").devices.shape == (2, 4)
    assert M.make_mesh("data=1").devices.size == 1
    assert M.make_mesh(None).devices.size == jax.device_count()
    with pytest.raises(ValueError, match="devices"):
        M.make_mesh("data=16")
    with pytest.raises(ValueError, match="axis=size"):
        M.make_mesh("rows=2")
    mesh = M.make_mesh("data=2,tensor=4")
    assert "tensor" in str(M.param_spec(mesh, "layers.0.attn.wq_b.weight", (64, 32)))
    with pytest.raises(ValueError, match="batch size"):
        M.check_batch(mesh, 3)

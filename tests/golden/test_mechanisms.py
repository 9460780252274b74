"""golden-check says what each case exercised: the counts behind each phrase, worked out by hand for the
tiny config (window 8, top-k 8, ratios 0,2,2,2,1,1,1, index sources 1,3,4,5, pool source layer 4 with 3
blocks of 4)."""
from dsv41_jax.config import ModelConfig
from dsv41_jax.golden.check import format_table
from dsv41_jax.golden.entry import Entry
from dsv41_jax.golden.mechanisms import exercised

CFG = ModelConfig.tiny()


def _case(*calls, images=None):
    case = {"schedule": [{"start_pos": s, "n_tokens": n} for s, n in calls]}
    if images:
        case["images"] = images
    return case


def test_a_short_prompt_selects_nothing():
    found = exercised(CFG, _case((0, 8)))
    assert "top-k keeps every position (<= 8)" in found
    # layer 4 (ratio 1) holds 8 compressed positions: 2 blocks of 4, all within the pool's 3
    assert "candidate pool keeps every block (2 <= 3)" in found
    assert not any(m.startswith("window ring") for m in found)


def test_selection_starts_past_top_k_and_the_pool_past_its_blocks():
    # 9 positions: the index sources 4, 5 read layer 4's ratio-1 cache (9 > 8 entries); 1 and 3 read
    # layer 1's ratio-2 cache (4 entries), so they keep everything
    found = exercised(CFG, _case((0, 9)))
    assert "top-k selects at layers 4,5 (up to 9 > 8 compressed positions)" in found
    assert "candidate pool keeps every block (3 <= 3)" in found
    assert "window ring wraps (9 > 8 positions)" in found
    # 13 positions: 13 compressed entries on layer 4 = 4 blocks of 4 > 3
    assert "candidate pool restricts (4 > 3 blocks of 4)" in exercised(CFG, _case((0, 13)))


def test_decode_steps_chunks_engram_and_images_are_named():
    found = exercised(CFG, _case((0, 5), (5, 4), (9, 1), (10, 1), images=[{"start": 1}]))
    assert "chunked prefill (2 calls)" in found and "decode (2 steps)" in found
    assert "Engram at layers 1,3" in found and "vision (1 image)" in found
    assert f"MoE per-row, {CFG.n_activated_experts} of {CFG.n_routed_experts} experts" in found
    # a call over 8 tokens runs the experts one at a time (exact mode's per-expert path)
    found = exercised(CFG, _case((0, 9), (9, 1)))
    assert f"MoE per-expert + per-row, {CFG.n_activated_experts} of {CFG.n_routed_experts} experts" in found


def test_the_table_prints_each_case_s_mechanisms_once():
    mech = ("top-k selects at layers 4 (up to 9 > 8 compressed positions)",)
    rows = format_table([Entry("c/a[free]", True, 0.0, mechanisms=mech), Entry("c/a[forced]", True, 0.0, mechanisms=mech),
                         Entry("c/b[free]", True, 0.0, mechanisms=("decode (3 steps)",))]).splitlines()
    assert sum("exercised:" in r for r in rows) == 2
    assert rows[1] == f"  exercised: {mech[0]}"
    assert Entry("x", True, mechanisms=mech).to_json()["mechanisms"] == mech


def test_a_drafter_case_names_its_stages_block_and_experts():
    import dataclasses

    cfg = dataclasses.replace(CFG, n_mtp_layers=3, dspark_block_size=5, dspark_markov_rank=256, dspark_target_layer_ids=(1, 2),
                              dspark_n_routed_experts=32, dspark_n_activated_experts=3)
    assert cfg.has_dspark
    found = exercised(cfg, _case((0, 9), (9, 1)))
    assert "DSpark drafts (3 stages, blocks of 5, Markov rank 256, 3 of 32 stage experts)" in found
    assert not any(m.startswith("DSpark") for m in exercised(CFG, _case((0, 9))))


def test_fast_numerics_name_the_grouped_moe_past_its_row_threshold():
    """--numerics fast runs a call's experts grouped once it has more than GROUPED_ROWS (token, expert) rows,
    per row below; exact mode never groups."""
    from dsv41_jax.layers.moe import GROUPED_ROWS

    k = CFG.n_activated_experts
    over = GROUPED_ROWS // k + 1  # the fewest tokens whose rows exceed the threshold
    tail = f"{k} of {CFG.n_routed_experts} experts"
    assert f"MoE grouped + per-row, {tail}" in exercised(CFG, _case((0, over), (over, 1)), "fast")
    assert f"MoE per-row, {tail}" in exercised(CFG, _case((0, over - 1), (over - 1, 1)), "fast")
    assert f"MoE grouped, {tail}" in exercised(CFG, _case((0, over)), "fast")
    assert f"MoE per-expert + per-row, {tail}" in exercised(CFG, _case((0, over), (over, 1)))

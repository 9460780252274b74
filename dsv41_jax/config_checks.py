"""How a config's layers fit together: the checks `ModelConfig.validated` runs after each field's
type and size. Every refusal is a ConfigError that names the field (and the layer where one is at
fault), so a malformed config.json fails before anything is built from it."""
from __future__ import annotations

# The checks take a `dsv41_jax.config.ModelConfig` (`c`); this module does not import it, since
# config.py imports these checks.

class ConfigError(ValueError):
    """A config that cannot describe a working V4.1 model."""


class ConfigWarning(UserWarning):
    """A config key that is probably a typo of a field (it is kept, unused, as an extra key)."""


def _fail(field_name: str, msg: str):
    raise ConfigError(f"{field_name}: {msg}")


def check_layout(c) -> None:
    """Shapes, the cache sources of every compressed layer, Engram, vision and DSpark."""
    _check_shapes(c)
    _check_sources(c)
    _check_engram_and_vision(c)
    if c.has_dspark:
        _check_dspark(c)
    for s in c.kv_source_layers:
        r = c.compress_ratios[s]
        if c.max_seq_len % r:
            _fail("max_seq_len", f"{c.max_seq_len} must be a multiple of layer {s}'s compress ratio {r}")


def _check_shapes(c) -> None:
    if len(c.compress_ratios) < c.n_layers:
        _fail("compress_ratios", f"has {len(c.compress_ratios)} entries but n_layers is {c.n_layers}")
    for l, r in enumerate(c.compress_ratios[: c.n_layers]):
        if r < 0:
            _fail("compress_ratios", f"layer {l} has negative ratio {r}")
    if c.head_dim % 32:
        _fail("head_dim", f"{c.head_dim} must be a multiple of 32 (FP8 window scales per 32, FP4 KV scales per 16)")
    if c.index_head_dim % 32:
        _fail("index_head_dim", f"{c.index_head_dim} must be a multiple of 32 (MXFP4 blocks)")
    if c.rope_head_dim % 2 or not 0 < c.rope_head_dim <= c.head_dim or c.rope_head_dim > c.index_head_dim:
        _fail("rope_head_dim", f"{c.rope_head_dim} must be even, positive and at most head_dim/index_head_dim")
    if c.n_heads % c.o_groups:
        _fail("o_groups", f"n_heads {c.n_heads} is not divisible by o_groups {c.o_groups}")
    if c.n_activated_experts > c.n_routed_experts:
        _fail("n_activated_experts", f"{c.n_activated_experts} exceeds n_routed_experts {c.n_routed_experts}")
    if c.n_shared_experts != 1:
        _fail("n_shared_experts", f"V4.1 has exactly one shared expert, got {c.n_shared_experts}")
    if c.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        _fail("score_func", f"unknown scoring function {c.score_func!r}")
    if c.dtype not in ("fp8", "bf16"):
        _fail("dtype", f"{c.dtype!r} must be 'fp8' or 'bf16'")
    if c.expert_dtype not in ("fp4", None):
        _fail("expert_dtype", f"{c.expert_dtype!r} must be 'fp4' or null")


def _check_sources(c) -> None:
    """Each compressed layer reads the KV and index keys of a source at or before it, with its ratio;
    the candidate pool's source is a Full layer whose pool can fill the top-k."""
    for name in ("kv_source_layers", "index_source_layers"):
        seq = getattr(c, name)
        if list(seq) != sorted(set(seq)):
            _fail(name, f"{list(seq)} must be strictly increasing")
        for l in seq:
            if not 0 <= l < c.n_layers:
                _fail(name, f"layer {l} is outside 0..{c.n_layers - 1}")
            if c.compress_ratios[l] == 0:
                _fail(name, f"layer {l} has compress ratio 0 (sliding window only) and cannot be a source")
    for l in range(c.n_layers):
        r = c.compress_ratios[l]
        if r == 0:
            continue
        kv = [s for s in c.kv_source_layers if s <= l]
        if not kv:
            _fail("kv_source_layers", f"layer {l} has compress ratio {r} but no KV source at or before it")
        if c.compress_ratios[kv[-1]] != r:
            _fail("compress_ratios", f"layer {l} has ratio {r} but its KV source (layer {kv[-1]}) has ratio {c.compress_ratios[kv[-1]]}")
        ix = [s for s in c.index_source_layers if s <= l]
        if not ix or ix[-1] < kv[-1]:
            _fail("index_source_layers", f"layer {l} reads KV of layer {kv[-1]} but no index source at or after it precedes layer {l}")
        if kv[-1] not in c.index_source_layers:
            _fail("index_source_layers", f"KV source layer {kv[-1]} (used by layer {l}) must also be an index source: it owns the index keys")
    cs = c.candidate_source_layer
    if cs >= 0:
        if cs not in c.kv_source_layers or cs not in c.index_source_layers:
            _fail("candidate_source_layer", f"layer {cs} must be both a KV source and an index source (a Full layer)")
        if c.candidate_block_size <= 0 or c.candidate_topk_blocks <= 0:
            _fail("candidate_topk_blocks", "candidate_topk_blocks and candidate_block_size must be positive")
        # the newest block may be partial, so a full pool supplies (blocks-1)*size+1 visible positions
        supply = (c.candidate_topk_blocks - 1) * c.candidate_block_size + 1
        if supply < c.index_topk:
            _fail("candidate_topk_blocks", f"a pool of {c.candidate_topk_blocks} blocks x {c.candidate_block_size} can guarantee only "
                 f"{supply} visible positions, fewer than index_topk={c.index_topk}; masked candidates would fill top-k slots")


def _check_engram_and_vision(c) -> None:
    for l in c.engram_layer_ids:
        if not 0 <= l < c.n_layers:
            _fail("engram_layer_ids", f"layer {l} is outside 0..{c.n_layers - 1}")
    if c.engram_layer_ids:
        if c.engram_max_ngram_size < 2 or c.engram_n_heads <= 0 or c.engram_head_dim % 32:
            _fail("engram_head_dim", "Engram needs max_ngram_size >= 2, heads > 0 and head_dim a multiple of 32")
        if c.engram_num_embeddings and len(c.engram_num_embeddings) != len(c.engram_layer_ids):
            _fail("engram_num_embeddings", f"{len(c.engram_num_embeddings)} entries for {len(c.engram_layer_ids)} Engram layers")
    if c.vision_n_layers < 0:
        _fail("vision_n_layers", f"must be >= 0 (0 = no vision tower), got {c.vision_n_layers}")
    if c.vision_enabled:
        if c.vision_dim <= 0 or c.vision_n_heads <= 0 or c.vision_dim % c.vision_n_heads:
            _fail("vision_n_heads", f"vision_dim {c.vision_dim} must be a positive multiple of vision_n_heads {c.vision_n_heads}")
        if (c.vision_dim // c.vision_n_heads) % 4:
            _fail("vision_n_heads", f"vision head dim {c.vision_dim // c.vision_n_heads} must be a multiple of 4 "
                 "(2-D RoPE rotates half-split pairs, half of them by row and half by column)")
        for name in ("vision_inter_dim", "vision_patch_size", "vision_downsample_ratio", "vision_min_pixels"):
            if getattr(c, name) <= 0:
                _fail(name, f"must be positive, got {getattr(c, name)}")
        if c.vision_max_n_token < 4:
            _fail("vision_max_n_token", f"{c.vision_max_n_token} cannot hold START, one IMAGE row and END")
        if c.vision_max_wh_ratio is not None and c.vision_max_wh_ratio <= 0:
            _fail("vision_max_wh_ratio", f"must be positive or null, got {c.vision_max_wh_ratio}")
        if not 0 <= c.image_token_id < c.vocab_size:
            _fail("image_token_id", f"{c.image_token_id} is outside the vocabulary 0..{c.vocab_size - 1}")


def _check_dspark(c) -> None:
    if not c.dspark_target_layer_ids:
        _fail("dspark_target_layer_ids", "DSpark needs at least one target layer (its taps feed main_proj)")
    for l in c.dspark_target_layer_ids:
        if not 0 <= l < c.n_layers:
            _fail("dspark_target_layer_ids", f"layer {l} is outside 0..{c.n_layers - 1}")
    if list(c.dspark_target_layer_ids) != sorted(set(c.dspark_target_layer_ids)):
        _fail("dspark_target_layer_ids", f"{list(c.dspark_target_layer_ids)} must be strictly increasing")
    if c.dspark_block_size < 2:
        _fail("dspark_block_size", f"{c.dspark_block_size}: a block is the anchor plus at least one draft")
    if not 0 <= c.dspark_noise_token_id < c.vocab_size:
        _fail("dspark_noise_token_id", f"{c.dspark_noise_token_id} is outside the vocabulary 0..{c.vocab_size - 1}")
    if c.dspark_markov_rank <= 0:
        _fail("dspark_markov_rank", f"must be positive, got {c.dspark_markov_rank}")
    routed, active = c.dspark_moe
    if active > routed:
        _fail("dspark_n_activated_experts", f"{active} exceeds dspark_n_routed_experts {routed}")
    stage_ratios = c.compress_ratios[c.n_layers: c.n_layers + c.n_mtp_layers]
    if any(stage_ratios):
        _fail("compress_ratios", f"DSpark stages (layers {c.n_layers}..) are window-only: their ratios must be 0, got {list(stage_ratios)}")

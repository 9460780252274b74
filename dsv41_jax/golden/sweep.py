"""Config sweep against the golden oracle: small golden-format folders for
configurations the shared golden set does not cover.

    ORACLE_REF=$ORACLE/ref python -m dsv41_jax.golden.sweep OUT_DIR --oracle ../shared/oracle \
        --python $ORACLE/venv/bin/python [--only NAME ...]

For each entry of CONFIGS this writes OUT_DIR/<name>/ in the golden format (golden/README.md):
`config.json` (`model_args` = the reference's ModelArgs), `weights.safetensors` (reference
state-dict names, FP8/E8M0/FP4 as raw bytes with `logical_dtypes`; random values from
`checkpoint.synthetic`, seeded), `cases.json`, and one tensor file per case computed by the oracle
(`harness.py run`, DeepSeek's reference with the oracle's CPU kernels; it needs the oracle installed,
docs/NUMERICS.md "Rebuilding the oracle"). EXTENSIONS (one DSpark, one vision folder) instead run the
oracle's own generators on a backbone written here. FULL_WIDTH and FULL_WIDTH_EXTENSIONS (the
released per-layer shapes, gigabytes of weights) are made only when named with --only. Every oracle run goes through
`oracle_host` (the AMD host's MKL sqrt and exp on any CPU). `MADE_BY.txt` records the command. Check a folder with
`dsv41 golden-check OUT_DIR --only <name>` (tests/golden/test_golden_sweep.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shlex
import subprocess
import sys

import numpy as np
from dsv41_jax.checkpoint.synthetic import model_from_params, random_params
from dsv41_jax.checkpoint.weights import to_reference_state_dict
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram.hashing import EngramLayout
from dsv41_jax.golden import oracle_host

# the shared golden set's main_fp8 arguments that every sweep config starts from (then shrunk)
BASE = dict(
    max_batch_size=1, max_seq_len=128, temperature=1.0, dtype="fp8", expert_dtype="fp4", vocab_size=128, dim=32,
    moe_inter_dim=32, n_layers=4, n_mtp_layers=0, n_heads=4, n_routed_experts=4, n_shared_experts=1,
    n_activated_experts=2, score_func="sqrtsoftplus", gate_temp=1.0, norm_topk_prob=True, route_scale=1.5,
    swiglu_limit=10.0, q_lora_rank=32, head_dim=64, rope_head_dim=32, norm_eps=1e-20, o_groups=2, o_lora_rank=32,
    window_size=16, compress_ratios=[0, 2, 1, 0], kv_source_layers=[1, 2], index_source_layers=[1, 2],
    compress_rope_theta=160000.0, original_seq_len=64, rope_theta=10000.0, rope_factor=16.0, beta_fast=32,
    beta_slow=1, index_n_heads=4, index_head_dim=64, index_topk=8, candidate_source_layer=-1,
    candidate_topk_blocks=0, candidate_block_size=0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=[], engram_num_embeddings=[], engram_max_ngram_size=1, engram_vocab_size=0, engram_n_heads=0,
    engram_head_dim=0, engram_pad_id=2, engram_compressed_vocab_size=0, vision_n_layers=0, dspark_block_size=0,
    dspark_noise_token_id=0, dspark_target_layer_ids=[], dspark_n_routed_experts=0, dspark_n_activated_experts=0,
)

# name -> (overrides of BASE, weight seed, token seed, cases); a case is ("prefill", L) or ("decode", P, S)
CONFIGS = {
    # rope_head_dim 64 (SLEEF powf on the frequency vector body), other head dim, thetas and YaRN
    "rope64_theta": (dict(head_dim=96, rope_head_dim=64, rope_theta=50000.0, compress_rope_theta=80000.0,
                          original_seq_len=32, rope_factor=8.0, beta_fast=16, beta_slow=2, window_size=8,
                          index_topk=4), 101, 201, [("prefill", 40), ("decode", 24, 8)]),
    # ratio 4 and a candidate pool, another window, gate/route parameters
    "ratio4_pool": (dict(n_layers=5, compress_ratios=[0, 4, 4, 1, 0], kv_source_layers=[1, 3],
                         index_source_layers=[1, 2, 3], candidate_source_layer=3, candidate_topk_blocks=3,
                         candidate_block_size=4, window_size=12, gate_temp=0.8, route_scale=2.5, swiglu_limit=7.0,
                         index_topk=6), 102, 202, [("prefill", 48), ("decode", 30, 8)]),
    # smaller head dims, more heads and groups, softmax gate
    "heads8_softmax": (dict(n_heads=8, head_dim=32, rope_head_dim=16, o_groups=4, o_lora_rank=32,
                            score_func="softmax", rope_theta=20000.0, index_n_heads=2, index_head_dim=32,
                            n_routed_experts=8, n_activated_experts=3), 103, 203,
                       [("prefill", 36), ("decode", 20, 6)]),
    # The following share one compilation between the prefill case and the decode case's prefill
    # (same length), so each folder costs four compilations. Every decode case is run and stored in
    # both index-key modes (published and corrected).
    # all four roles in six layers (main_fp8's layout at other ratios), pool 2 x 5 on ratio 1, a
    # 128-token prompt, max_seq_len 160, heads of 32 (RoPE 16) and index heads of 32, vocab 64 (size)
    "layout6_long128": (dict(n_layers=6, compress_ratios=[0, 2, 2, 2, 1, 1], kv_source_layers=[1, 4],
                             index_source_layers=[1, 3, 4, 5], candidate_source_layer=4, candidate_topk_blocks=2,
                             candidate_block_size=5, index_topk=5, window_size=6, max_seq_len=160, head_dim=32,
                             rope_head_dim=16, index_head_dim=32, vocab_size=64), 104, 204,
                        [("prefill", 128), ("decode", 128, 6)]),
    # ratio 8 (Full, Reindex, Reuse), sigmoid gate without top-k renormalisation, 6 experts, o_lora 16
    "ratio8_sigmoid": (dict(compress_ratios=[0, 8, 8, 8], kv_source_layers=[1], index_source_layers=[1, 2],
                            score_func="sigmoid", norm_topk_prob=False, n_routed_experts=6, route_scale=1.0,
                            index_topk=3, o_lora_rank=16), 105, 205, [("prefill", 72), ("decode", 72, 10)]),
    # two residual copies, other Sinkhorn iterations and eps, BF16 linears and BF16 experts, norm eps
    "hc2_bf16": (dict(hc_mult=2, hc_sinkhorn_iters=7, hc_eps=1e-4, dtype="bf16", expert_dtype=None, norm_eps=1e-6,
                      kv_source_layers=[1, 2]), 106, 206, [("prefill", 33), ("decode", 33, 7)]),
    # wider model in two layers: dim 64, vocab 256, 2 heads x 128 in one output group, 1 index head x 96
    "dims_wide": (dict(n_layers=2, compress_ratios=[0, 2], kv_source_layers=[1], index_source_layers=[1], dim=64,
                       vocab_size=256, moe_inter_dim=64, q_lora_rank=64, n_heads=2, head_dim=128, o_groups=1, o_lora_rank=32, index_n_heads=1, index_head_dim=96), 107, 207,
                  [("prefill", 20), ("decode", 20, 4)]),
    # a Full ratio-2 layer 0, a window-only layer between two ratio-1 layers (Full, Reuse), window 20
    # longer than the prompt (the ring fills during decode), batch-2 caches, temperature 0.5
    "layout_full0_swa": (dict(n_layers=5, compress_ratios=[2, 0, 1, 1, 0], kv_source_layers=[0, 2],
                              index_source_layers=[0, 2], window_size=20, max_batch_size=2, max_seq_len=96,
                              temperature=0.5), 108, 208, [("prefill", 18), ("decode", 18, 6)]),
    # Engram before layers 0 and 2: 2- and 3-grams, 2 heads x 32, bucket base 150, pad id 1; the token
    # map is TOKEN_MAPS' rule
    "engram02": (dict(engram_layer_ids=[0, 2], engram_max_ngram_size=3, engram_vocab_size=150, engram_n_heads=2,
                      engram_head_dim=32, engram_pad_id=1), 109, 209, [("prefill", 30), ("decode", 30, 6)]),
    # candidate pool 3 x 3 on a ratio-2 source, top-k 7, 16 experts top-4, no SwiGLU clamp; 3 layers (size)
    "pool_r2_experts16": (dict(n_layers=3, compress_ratios=[0, 2, 2], kv_source_layers=[1], index_source_layers=[1, 2],
                               candidate_source_layer=1, candidate_topk_blocks=3, candidate_block_size=3,
                               index_topk=7, n_routed_experts=16, n_activated_experts=4, route_scale=1.0,
                               gate_temp=1.3, swiglu_limit=0.0), 110, 210, [("prefill", 44), ("decode", 44, 8)]),
    # two adjacent Full ratio-2 layers, Full + Reindex ratio 4, window 4, top-k 2; other thetas and a
    # stronger YaRN (factor 40 from 16 positions, beta 8/1); heads of 32 with RoPE 16
    "adjacent_full_r4": (dict(n_layers=6, compress_ratios=[0, 2, 2, 4, 4, 0], kv_source_layers=[1, 2, 3],
                              index_source_layers=[1, 2, 3, 4], window_size=4, index_topk=2, rope_theta=1e5,
                              compress_rope_theta=1e6, rope_factor=40.0, original_seq_len=16, beta_fast=8,
                              beta_slow=1, head_dim=32, rope_head_dim=16), 111, 211, [("prefill", 50), ("decode", 50, 6)]),
    # softmax top-1 of 3 experts, 3 residual copies, 6 heads in 3 groups, RoPE on 8 dims, 1 index
    # head; ratio-1 Full + Reindex without a pool
    "softmax_top1_hc3": (dict(score_func="softmax", n_activated_experts=1, n_routed_experts=3, hc_mult=3,
                              n_heads=6, o_groups=3, rope_head_dim=8, index_n_heads=1,
                              compress_ratios=[0, 1, 1, 0], kv_source_layers=[1], index_source_layers=[1, 2]),
                         112, 212, [("prefill", 40), ("decode", 40, 6)]),
}

# The released per-layer shapes (docs/NUMERICS.md "At the released width"): dim, heads, LoRA ranks,
# output groups, index heads, window, index top-k, YaRN, mHC 4, 6 active experts. What is smaller:
# the vocabulary (not a layer shape), the layer count, and 16 routed experts of the 384: the
# generator draws every weight in float32 before quantizing it (one layer's 384 experts are 54 GB
# there, 16 are 2.3 GB, on a 24 GB machine), and 16 keeps every expert in use at 520 tokens x 6.
RELEASED_LAYER = dict(dim=5120, moe_inter_dim=2304, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1280,
                      o_groups=8, o_lora_rank=1024, window_size=128, index_n_heads=32, index_head_dim=128,
                      index_topk=512, n_routed_experts=16, n_activated_experts=6, compress_rope_theta=160000.0,
                      original_seq_len=65536, rope_factor=16.0, beta_fast=32, beta_slow=1, vocab_size=512)

# Full-width folders, made only when named with --only (gigabytes of weights: they stay outside the
# repository, docs/NUMERICS.md has their commands and checksums)
FULL_WIDTH = {
    # the default suite's full-width case (tests/data/wide, weights regenerated from the seed): one
    # Full ratio-1 layer with 8 experts, a 72-token prompt and a top-k of 16: the top-k selects, and
    # the last rows' 72 window + 16 compressed entries span two of sparse attention's 64-wide blocks
    "wide_r1_short": (dict(RELEASED_LAYER, n_layers=1, compress_ratios=[1], kv_source_layers=[0],
                           index_source_layers=[0], index_topk=16, n_routed_experts=8, max_seq_len=96),
                      120, 220, [("prefill", 72)]),
    # one Full ratio-1 layer; 520 tokens: 520 compressed positions, so the top-k of 512 selects
    "wide_full_r1": (dict(RELEASED_LAYER, n_layers=1, compress_ratios=[1], kv_source_layers=[0],
                          index_source_layers=[0], max_seq_len=640), 121, 221, [("prefill", 520)]),
    # one layer of each role: SWA, Full r2 + Engram (8 heads x 256, 4-grams, tables of ~24 x 1000
    # rows), Reuse, Full r1 + pool source, Reindex r1. A 1040-token prompt: 520 ratio-2 positions
    # (top-k selects), 1040 ratio-1 positions over a pool of 96 blocks of 8 (the pool restricts),
    # then 4 decode steps
    "wide_roles": (dict(RELEASED_LAYER, n_layers=5, compress_ratios=[0, 2, 2, 1, 1], kv_source_layers=[1, 3],
                        index_source_layers=[1, 3, 4], candidate_source_layer=3, candidate_topk_blocks=96,
                        candidate_block_size=8, engram_layer_ids=[1], engram_max_ngram_size=4,
                        engram_vocab_size=1000, engram_n_heads=8, engram_head_dim=256, max_seq_len=1088),
                   122, 222, [("decode", 1040, 4)]),
}

# Engram configs' synthetic tokenizer maps (golden/README.md's rule with other constants):
# key = (id * mult) % mod, compressed ids handed out in first-seen order of key over id = 0..vocab-1
TOKEN_MAPS = {"engram02": (31, 53), "wide_roles": (37, 211)}

# a small three-layer backbone for the DSpark and vision folders (heads of 32, RoPE 16)
SMALL = dict(n_layers=3, compress_ratios=[0, 2, 0], kv_source_layers=[1], index_source_layers=[1], head_dim=32,
             rope_head_dim=16, index_head_dim=32)
# Folders made by the oracle's own DSpark and vision generators (shared/oracle dspark.py,
# vision_golden.py) with their module-level arguments replaced: name -> (generator module, its
# arguments dict, replacements, backbone overrides of BASE, backbone weight seed, generator options).
EXTENSIONS = {
    # 3 DSpark stages (the generator's count) of block 3 tapping layers 1 and 2, Markov rank 16,
    # 3 stage experts top-1, noise id 100
    "dspark_small": ("dspark", "DSPARK_ARGS",
                     dict(n_mtp_layers=3, dspark_block_size=3, dspark_noise_token_id=100, dspark_target_layer_ids=[1, 2],
                          dspark_markov_rank=16, dspark_n_routed_experts=3, dspark_n_activated_experts=1,
                          temperature=0.0),
                     SMALL, 113, ["--mtp-seed", "123", "--token-seed", "213", "--name", "dspark_small",
                                  "--cases", "dspark_P20_S4"]),
    # a one-block ViT of width 32 (2 heads), patches of 4, 2x2 downsampling, image token 127
    "vision_small": ("vision_golden", "VISION_ARGS",
                     dict(vision_n_layers=1, vision_dim=32, vision_n_heads=2, vision_inter_dim=64, vision_patch_size=4,
                          vision_rope_theta=5000.0, vision_downsample_ratio=2, image_token_id=127),
                     SMALL, 114, ["--vision-seed", "124", "--pixel-seed", "224", "--token-seed", "214",
                                  "--cases", "vl_prefill_L24_i3x4x5", "vl_decode_P20_S4_i2x3x3"]),
}
# Extensions at full width, made only when named with --only like FULL_WIDTH (the tower's weights are
# ~60 MB: they stay outside the repository). "vision_wide": the released vision tower's per-layer
# shapes (width 1024, 16 heads x 64, MLP 2816, patches of 14, 3x3 aligner downsample, RoPE theta
# 10000) in 2 of its 32 layers, on the small backbone; one prompt with two images of different grids
# (12 x 18 patches, and 10 x 17, which the aligner pads to 12 x 18 cells of 3 x 3)
# "dspark_wide": the released drafter's shapes (3 stages, block 5, Markov rank 256, 3 active experts)
# except 32 routed experts per stage, not 128. dspark.py holds three copies of the whole weight file at
# once (the drawn stage tensors with the backbone's, the file read back, the reference model's clones of
# it) plus the run's temporaries, on a 23 GB machine without swap: the file is 4.0 GB at 32 (the stages'
# experts 1.8 GB of it), 5.8 GB at 64, 9.4 GB at 128. The drafter runs its experts on 5 block rows a
# step, so 3 of 32 already leaves most experts idle, as 3 of 128 would. The backbone is 3 released-width
# layers (SWA, Full r1 as KV and index source, SWA), all three tapped; its 526-token prompt puts 526
# positions in the ratio-1 cache, so the top-k of 512 selects and the window ring wraps before the
# drafter reads the taps, then 6 decode steps each draft a block. dspark.py draws only 128 tokens
# itself: the prompt comes from a token-source folder written beside the backbone (`TOKEN_STREAMS`).
FULL_WIDTH_EXTENSIONS = {
    "vision_wide": ("vision_golden", "VISION_ARGS",
                    dict(vision_n_layers=2, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
                         vision_patch_size=14, vision_rope_theta=10000.0, vision_downsample_ratio=3,
                         image_token_id=127),
                    SMALL, 115, ["--vision-seed", "125", "--pixel-seed", "225", "--token-seed", "215",
                                 "--cases", "vl_prefill_L120_i3x12x18_i60x10x17"]),
    "dspark_wide": ("dspark", "DSPARK_ARGS",
                    dict(n_mtp_layers=3, dspark_block_size=5, dspark_noise_token_id=500, dspark_target_layer_ids=[0, 1, 2],
                         dspark_markov_rank=256, dspark_n_routed_experts=32, dspark_n_activated_experts=3,
                         temperature=0.0),
                    dict(RELEASED_LAYER, n_layers=3, compress_ratios=[0, 1, 0], kv_source_layers=[1],
                         index_source_layers=[1], max_seq_len=544),
                    116, ["--mtp-seed", "126", "--name", "dspark_wide", "--cases", "dspark_P526_S6"]),
}
# Extensions whose generator reads its prompt from a token-source folder (dspark.py's --token-source,
# --token-case): name -> (token seed, tokens). `write_token_source` writes it in the scratch folder.
TOKEN_STREAMS = {"dspark_wide": (226, 532)}
TOKEN_CASE = "stream"  # the token-source folder's one case
ALL = sorted(CONFIGS) + sorted(EXTENSIONS)

# runs one generator of the oracle folder with its arguments dict updated (argv: module, attribute,
# JSON of the replacements, then the generator's own command line)
_RUN_GENERATOR = """import gc, importlib, json, sys
sys.path.insert(0, '.')
import harness
_build = harness.build_model

def _build_after_collect(*args, **kwargs):
    gc.collect()  # the previous run's model is held by reference cycles (the generators' hooks): free it first
    return _build(*args, **kwargs)

harness.build_model = _build_after_collect
mod = importlib.import_module(sys.argv[1])
getattr(mod, sys.argv[2]).update(json.loads(sys.argv[3]))
sys.argv = [sys.argv[1] + '.py'] + sys.argv[4:]
mod.main()
"""


def spec(name: str) -> tuple:
    """(overrides of BASE, weight seed, token seed, cases) of a CONFIGS or FULL_WIDTH entry."""
    return CONFIGS[name] if name in CONFIGS else FULL_WIDTH[name]


def model_args(name: str) -> dict:
    over = spec(name)[0]
    args = {**BASE, **over}
    if args["engram_layer_ids"]:
        layout = engram_layout(name, args)
        args["engram_compressed_vocab_size"] = layout.compressed_vocab_size
        args["engram_num_embeddings"] = list(layout.num_embeddings)
    return args


def token_map(name: str, vocab: int) -> list[int]:
    mult, mod = TOKEN_MAPS[name]
    first: dict[int, int] = {}
    return [first.setdefault((i * mult) % mod, len(first)) for i in range(vocab)]


def engram_layout(name: str, args: dict):
    """Primes, offsets and multipliers as our hashing derives them (stored in config.json; the oracle
    derives its own from model_args, so a disagreement shows up as different logits)."""
    size = max(token_map(name, args["vocab_size"])) + 1
    return EngramLayout.from_model_args({**args, "engram_compressed_vocab_size": size})


def write_weights(path: pathlib.Path, args: dict, seed: int, all_logical: bool = False) -> tuple[str, dict]:
    """Random weights in the reference's names and checkpoint dtypes; returns (sha256, tensors meta).
    all_logical: name every tensor's dtype in `logical_dtypes` (vision_golden.py reads them all)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    cfg = ModelConfig.from_dict(args)
    sd = to_reference_state_dict(model_from_params(cfg, random_params(cfg, seed)))
    store, logical = {}, {}
    for k, v in sorted(sd.items()):
        v = np.asarray(v)
        kind = _logical(k, v, args)
        if kind is not None:
            logical[k] = kind
            v = v.view(np.uint8)
        elif v.dtype == np.float32 and np.array_equal(v.astype(ml_dtypes.bfloat16).astype(np.float32), v):
            v = v.astype(ml_dtypes.bfloat16)  # bf16-valued (wo_a, index wk, ...): half the bytes, loaded exactly
        store[k] = np.ascontiguousarray(v)
    names = {"float32": "F32", "bfloat16": "BF16"}
    if all_logical:
        logical = {k: logical.get(k, names.get(str(v.dtype), str(v.dtype))) for k, v in store.items()}
    save_file(store, str(path), metadata={"logical_dtypes": json.dumps(logical)})
    meta = {k: {"dtype": logical.get(k, names.get(str(v.dtype), str(v.dtype))), "shape": list(v.shape)}
            for k, v in store.items()}
    return hashlib.sha256(path.read_bytes()).hexdigest(), meta


def _logical(name: str, v: np.ndarray, args: dict) -> str | None:
    """The reference dtype of a raw-byte tensor (golden/README.md "Weights"), None for plain floats."""
    dt = str(v.dtype)
    if "float8_e4m3" in dt:
        return "F8_E4M3FN"
    if "e8m0" in dt or (dt == "uint8" and name.endswith("scale")):
        return "F8_E8M0FNU"
    if dt == "uint8" or "float4" in dt:
        return "F4_E2M1FN_X2"
    return None


def write_token_source(folder: pathlib.Path, seed: int, n: int, vocab: int) -> list[str]:
    """A folder dspark.py takes as --token-source: `TOKEN_CASE`.safetensors holding `tokens` (int64 [n],
    numpy default_rng(seed).integers(0, vocab, n), the rule of the generator's own 128) and a cases.json
    whose first case names the seed. Returns the generator options that read it."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(seed).integers(0, vocab, n).astype(np.int64)
    save_file({"tokens": tokens}, str(folder / f"{TOKEN_CASE}.safetensors"))
    (folder / "cases.json").write_text(json.dumps({"cases": [{"name": TOKEN_CASE, "token_seed": seed,
                                                              "token_rule": "numpy default_rng(seed).integers(0, vocab, n)"}]}))
    return ["--token-source", str(folder), "--token-case", TOKEN_CASE]


def write_extension(out: pathlib.Path, name: str, oracle: pathlib.Path, python: str) -> None:
    """A DSpark or vision folder: our backbone weights in a scratch folder, then the oracle's generator."""
    import tempfile

    module, attr, replace, over, wseed, opts = {**EXTENSIONS, **FULL_WIDTH_EXTENSIONS}[name]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        bb = pathlib.Path(tmp)
        args = {**BASE, **over}
        sha, meta = write_weights(bb / "weights.safetensors", args, wseed, all_logical=True)
        (bb / "config.json").write_text(json.dumps({"name": name + "_backbone", "model_args": args, "weight_seed": wseed,
                                                    "tensors": meta, "weights_sha256": sha}))
        if name in TOKEN_STREAMS:  # a fixed folder name: the generator records it in cases.json
            opts = opts + write_token_source(bb / f"{name}_tokens", *TOKEN_STREAMS[name], args["vocab_size"])
        cmd = [python, "-c", oracle_host.generator_code(_RUN_GENERATOR), str(oracle_host.TABLE), module, attr,
               json.dumps(replace), str(d.resolve()), "--backbone", str(bb)] + opts
        subprocess.run(cmd, check=True, cwd=str(oracle), stdout=subprocess.DEVNULL, env=_env())
    raw = json.loads((d / "config.json").read_text())
    raw["name"] = name  # vision_golden.py names every folder vision_fp8
    (d / "config.json").write_text(json.dumps(raw, indent=1))
    for f in d.iterdir():
        f.chmod(0o644)
    (d / "MADE_BY.txt").write_text("ORACLE_REF=$ORACLE/ref python -m dsv41_jax.golden.sweep " + " ".join(shlex.quote(a) for a in sys.argv[1:])
                                   + f"\n(config {name}: backbone from sweep.py, then shared/oracle/{module}.py with "
                                   f"{attr} updated by {json.dumps(replace)} and options {' '.join(opts)};\n"
                                   " oracle: torch 2.14.1 reference, docs/NUMERICS.md)\n")


def write_folder(out: pathlib.Path, name: str, oracle: pathlib.Path, python: str) -> None:
    if name in EXTENSIONS or name in FULL_WIDTH_EXTENSIONS:
        return write_extension(out, name, oracle, python)
    over, wseed, tseed, cases = spec(name)
    args = model_args(name)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    sha, meta = write_weights(d / "weights.safetensors", args, wseed)
    (d / "weights.safetensors").chmod(0o644)
    n_tok = max(128, max(sum(c[1:]) for c in cases))
    tokens = np.random.default_rng(tseed).integers(0, args["vocab_size"], n_tok).tolist()
    cfg = {"name": name, "model_args": args, "weight_seed": wseed, "tensors": meta, "weights_sha256": sha,
           "trace_layers": []}
    if args["engram_layer_ids"]:
        layout = engram_layout(name, args)
        mult, mod = TOKEN_MAPS[name]
        cfg["engram"] = {"synthetic_token_map_rule": f"key = (id * {mult}) % {mod}; compressed ids handed out in "
                                                     "first-seen order of key over id = 0..vocab-1",
                         "token_map": token_map(name, args["vocab_size"]),
                         "compressed_vocab_size": layout.compressed_vocab_size,
                         "pad_compressed_id": token_map(name, args["vocab_size"])[args["engram_pad_id"]],
                         "primes": layout.primes.tolist(), "offsets": layout.offsets.tolist(),
                         "multipliers": layout.multipliers.tolist()}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    entries = []
    for c in cases:
        if c[0] == "prefill":
            L = c[1]
            entries.append({"name": f"prefill_L{L}", "file": f"prefill_L{L}.safetensors", "kind": "prefill",
                            "token_seed": tseed, "tokens": tokens[:L], "schedule": [{"start_pos": 0, "n_tokens": L}]})
        else:
            P, S = c[1], c[2]
            entries.append({"name": f"decode_P{P}_S{S}", "file": f"decode_P{P}_S{S}.safetensors", "kind": "decode",
                            "token_seed": tseed, "tokens": tokens[:P + S],
                            "schedule": [{"start_pos": 0, "n_tokens": P}] + [{"start_pos": i, "n_tokens": 1}
                                                                              for i in range(P, P + S)]})
    (d / "cases.json").write_text(json.dumps({"config": name, "weights_file": "weights.safetensors",
                                              "weights_sha256": sha, "cases": entries}, indent=1))
    for e in entries:
        cmd = oracle_host.harness_command(python, "run", str(d.resolve()), e["name"], str((d / e["file"]).resolve()))
        subprocess.run(cmd, check=True, cwd=str(oracle), stdout=subprocess.DEVNULL, env=_env())
        (d / e["file"]).chmod(0o644)
    (d / "MADE_BY.txt").write_text("ORACLE_REF=$ORACLE/ref python -m dsv41_jax.golden.sweep " + " ".join(shlex.quote(a) for a in sys.argv[1:])
                                   + f"\n(config {name}; oracle: torch 2.14.1 reference with the AMD host's MKL math, golden/oracle_host.py, docs/NUMERICS.md)\n")


def _env() -> dict:
    import os

    if "ORACLE_REF" not in os.environ:
        raise SystemExit("set ORACLE_REF to the oracle's reference cache (the folder holding dsv41ref/, "
                         "docs/NUMERICS.md \"Rebuilding the oracle\")")
    return oracle_host.env()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--oracle", required=True, help="the oracle folder (harness.py)")
    ap.add_argument("--python", required=True, help="the oracle venv's python (torch 2.14.1)")
    ap.add_argument("--only", action="append", choices=ALL + sorted(FULL_WIDTH) + sorted(FULL_WIDTH_EXTENSIONS))
    a = ap.parse_args(argv)
    for name in a.only or ALL:
        write_folder(pathlib.Path(a.out), name, pathlib.Path(a.oracle).resolve(), a.python)
        print(f"wrote {a.out}/{name}", flush=True)


if __name__ == "__main__":
    main()
